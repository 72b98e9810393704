"""The training outcome under echo: a model trained through cachefeed with a slow remote, against full-data training.

    python -m benchmarks.outcome [--samples 6000] [--dim 4096] [--steps 0] [--rate 800] [--remote-share 0.33]

A synthetic task (10 classes; a sample is ``--dim`` float32 values, 16 KiB: a class mean over 64 blocks plus unit
noise, overlapping so that the model reaches about 87%; its model is small next to the data, the case where data
echoing is known to cost little, so a gap here would be cachefeed's, not the echo's), a ``file://`` remote on /dev/shm
of msgpack objects (50 samples each), a cache budget of 30% of the dataset and the remote capped
(``remote.max_bytes_per_s``) at ``--remote-share`` of the rate training reads (``--rate`` samples/s: each step is padded
to that pace, as a model on an accelerator would). The same linear classifier (same initial weights, SGD, batch 64) is
trained for the same number of steps (``--steps``, default three passes' worth of the dataset):

* ``full data``: batches drawn without replacement from the whole dataset in memory, reshuffled every pass;
* ``cachefeed``: ``EpochLoaderFactory`` defaults (2 workers) over the daemon's cache: the remote delivers a third
  of what training reads, so epochs re-read cached samples (the echo factor: reads per distinct sample).

Printed: test accuracy of each (on 2,000 held-out samples), the distinct samples cachefeed's loop received, the
reads per distinct sample, and the longest handover wait. Writes ``benchmarks/results/outcome.json``
(``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import torch

from benchmarks.common.results import readme_block, save
from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._trainer import EpochLoaderFactory

CLASSES = 10
PER_OBJECT = 50
BATCH = 64
TEST_SAMPLES = 2000
SCALE = 0.045  # the class means' spread: about 87% reachable, and as much from a third of the data


FEATURES = 64  # what the model sees: the sample's mean over each of 64 blocks


def task(samples: int, dim: int, seed: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """``samples`` points of the task: a class mean in ``FEATURES`` dimensions, each repeated over a block of
    ``dim / FEATURES`` values, plus unit noise on every value (the means are fixed by the task, the points by
    ``seed``)."""
    means = np.random.default_rng(12345).normal(0.0, 1.0, size=(CLASSES, FEATURES)).astype(np.float32) * SCALE
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, size=samples)
    points = np.repeat(means[labels], dim // FEATURES, axis=1) + rng.normal(0.0, 1.0, size=(samples, dim))
    return points.astype(np.float32), labels.astype(np.int64)


def write_remote(root: Path, points: npt.NDArray[np.float32], labels: npt.NDArray[np.int64]) -> int:
    root.mkdir(parents=True)
    nbytes = 0
    for start in range(0, len(labels), PER_OBJECT):
        records = [{"x": points[i], "y": int(labels[i])} for i in range(start, min(start + PER_OBJECT, len(labels)))]
        blob = msgpack.packb(records, default=msgpack_default)
        (root / f"part-{start // PER_OBJECT:05d}.msgpack").write_bytes(blob)
        nbytes += len(blob)
    return nbytes


class Trainer:
    """A linear classifier on the block means (650 weights: small next to the data, so data echoing costs little
    by construction), SGD; every step padded to ``step_s`` (the pace of a model on an accelerator)."""

    def __init__(self, dim: int, step_s: float) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(FEATURES, CLASSES)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1.0)
        self.step_s = step_s

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.reshape(len(x), FEATURES, -1).mean(dim=2))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        started = time.perf_counter()
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self._logits(x), y).backward()
        self.optimizer.step()
        left = self.step_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)

    def accuracy(self, points: npt.NDArray[np.float32], labels: npt.NDArray[np.int64]) -> float:
        with torch.no_grad():
            predicted = self._logits(torch.from_numpy(points)).argmax(dim=1).numpy()
        return float((predicted == labels).mean())


def full_data(points: npt.NDArray[np.float32], labels: npt.NDArray[np.int64], steps: int, step_s: float) -> Trainer:
    trainer = Trainer(points.shape[1], step_s)
    rng = np.random.default_rng(1)
    done = 0
    while done < steps:
        order = rng.permutation(len(labels))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            chosen = order[start : start + BATCH]
            trainer.step(torch.from_numpy(points[chosen]), torch.from_numpy(labels[chosen]))
            done += 1
            if done == steps:
                break
    return trainer


def through_cachefeed(work: Path, remote: Path, nbytes: int, args: argparse.Namespace) -> dict[str, Any]:
    cache_dir = work / "cache"  # removed with ``work`` (RAM on tmpfs)
    rate = int(args.rate * (nbytes / args.samples) * args.remote_share)
    document = {
        "remote": {"url": f"file://{remote}", "refresh_interval": "60s", "max_bytes_per_s": rate},
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": int(nbytes * 0.3),
            "segment_bytes": max(256 << 10, int(nbytes * 0.3) // 20),  # small next to the budget: eviction's unit
            "min_free_bytes": 0,
            "fsync": False,
        },
        "sampler": {"processes": 1, "concurrency": 4, "decode": "msgpack"},
        "status": {"interval": "200ms"},
    }
    config = work / "daemon.toml"
    config.write_text(toml_text(document))
    daemon = start_daemon(config, cache_dir, work / "daemon.stderr")
    trainer = Trainer(args.dim, 1.0 / (args.rate / BATCH))
    seen: collections.Counter[str] = collections.Counter()
    handovers: list[float] = []
    done = 0
    try:
        with EpochLoaderFactory(
            cache_dir, batch_size=BATCH, num_workers=2, run_id="outcome", progress=None, wait_timeout_s=60
        ) as factory:
            for epoch in itertools.count():
                for batch in factory.loader(epoch):
                    trainer.step(batch["x"], batch["y"])
                    seen.update(batch["__key__"])
                    done += 1
                    if done == args.steps:
                        break
                wait = factory.stats(epoch).handover_wait_s
                if wait is not None:
                    handovers.append(wait)
                if done == args.steps:
                    break
    finally:
        daemon.stop()
    return {
        "trainer": trainer,
        "distinct": len(seen),
        "reads_per_sample": sum(seen.values()) / max(1, len(seen)),
        "max_handover_s": max(handovers, default=0.0),
        "epochs": len(handovers) + 1,
        "remote_bytes_per_s": rate,
    }


def readme_table(doc: dict[str, Any]) -> str:
    f = doc["figures"]
    intro = (
        f"The training outcome under echo: a linear classifier on a synthetic 10-class task ({f['samples']:,} samples "
        f"of 16 KiB), {f['steps']} steps of 64 at {f['rate']:g} samples/s, a 30% budget, the remote capped at "
        f"{f['remote_share']:.0%} of what training reads."
    )
    rows = [
        "| trained on | test accuracy | distinct samples seen | reads per distinct sample | longest handover |",
        "|---|---|---|---|---|",
        f"| full data, in memory | {f['full_accuracy']:.1%} | {f['samples']:,} | – | – |",
        f"| cachefeed, the remote at {f['remote_share']:.0%} | {f['cachefeed_accuracy']:.1%} | {f['distinct']:,} | "
        f"{f['reads_per_sample']:.2f} | {f['max_handover_s'] * 1000:.1f} ms |",
    ]
    return readme_block(intro, rows, doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=0, help="0: three passes' worth")
    parser.add_argument("--rate", type=float, default=800.0, help="samples/s training reads")
    parser.add_argument("--remote-share", type=float, default=1 / 3)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    args.steps = args.steps or 3 * args.samples // BATCH
    torch.set_num_threads(1)
    points, labels = task(args.samples, args.dim, seed=2)
    test_points, test_labels = task(TEST_SAMPLES, args.dim, seed=3)
    full = full_data(points, labels, args.steps, step_s=0.0)
    full_accuracy = full.accuracy(test_points, test_labels)
    print(f"full data: {full_accuracy:.3f} after {args.steps} steps", flush=True)
    with tempfile.TemporaryDirectory(prefix="cf-outcome-", dir="/dev/shm") as tmp:
        work = Path(tmp)
        nbytes = write_remote(work / "remote", points, labels)
        run = through_cachefeed(work, work / "remote", nbytes, args)
        accuracy = run["trainer"].accuracy(test_points, test_labels)
        print(
            f"cachefeed: {accuracy:.3f}, {run['distinct']} distinct samples seen, {run['reads_per_sample']:.2f} reads "
            f"each, longest handover {run['max_handover_s'] * 1000:.1f} ms over {run['epochs']} epochs",
            flush=True,
        )
        figures = {
            "samples": args.samples,
            "steps": args.steps,
            "rate": args.rate,
            "remote_share": args.remote_share,
            "full_accuracy": full_accuracy,
            "cachefeed_accuracy": accuracy,
            "distinct": run["distinct"],
            "reads_per_sample": run["reads_per_sample"],
            "max_handover_s": run["max_handover_s"],
            "epochs": run["epochs"],
        }
        if not args.no_save:
            print(f"results: {save('outcome', figures, work_dir=work)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
