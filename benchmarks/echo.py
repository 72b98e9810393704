"""Echo: how often training reads each sample, where the remote keeps up and where it is three times slower.

    python -m benchmarks.echo [--samples 6000] [--sample-kib 16] [--budget 0.3] [--rate 800] [--capped-passes 3]
                              [--turnover 50%] [--runs NAME ...] [--no-save]

A ``file://`` remote on /dev/shm of ``--samples`` samples of ``--sample-kib`` KiB (msgpack objects of 10), a cache
of ``--budget`` of the dataset (the daemon's defaults otherwise: ``cache.turnover`` 67% unless ``--turnover`` says,
``evict_after_reads = 1``), and a trainer that reads through ``EpochLoaderFactory`` (2 workers, batches of 16,
default epochs: one pass over each snapshot) at ``--rate`` samples/s (a busy loop for the rest of each batch's slot
of ``16 / rate`` seconds: the time ``next()`` took counts in the slot; a batch that comes late starts a new slot).
Two runs:

* ``remote keeps up``: no cap, for one pass's worth of samples (``--samples``, counted from the batches the loop
  received);
* ``remote at a third``: ``remote.max_bytes_per_s`` = a third of training's bytes per second, for
  ``--capped-passes`` passes' worth (one pass is over before the cache's initial fill is behind it).

Printed per run, from what the loop received: the distinct share of the samples served, reads per sample (samples
served over distinct samples; and over whole lifetimes, for the samples first served after the first four epochs
and evicted by the end, as the witness saw their segments go), the handover waits (``EpochStats``), status's echo
factor (at the end) and ingest bound (as status said it at each epoch's end, after the first four). Writes
``benchmarks/results/echo.json`` (``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from benchmarks.common.results import dash, readme_block, save
from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import SegmentWitness, Served, final_status, sample_keys
from cachefeed._trainer import EpochLoaderFactory

RUNS = ("remote keeps up", "remote at a third")
PER_OBJECT = 10
BATCH = 16
WARM_EPOCHS = 4  # epochs whose first-served samples are left out of the lifetime reads (the initial fill)


def make_remote(root: Path, samples: int, sample_bytes: int) -> Path:
    root.mkdir(parents=True)
    for obj in range(-(-samples // PER_OBJECT)):
        rows = [{"data": payload(f"{obj}/{i}", sample_bytes)} for i in range(PER_OBJECT)]
        (root / f"obj-{obj:05d}.msgpack").write_bytes(msgpack.packb(rows, default=msgpack_default))
    return root


class _Witness:
    """``SegmentWitness`` in a process of its own: it opens and verifies every segment every few milliseconds, which
    in the training process would take the interpreter from the training loop (and slow the measured rate)."""

    def __init__(self, cache_dir: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_witness_main, args=(cache_dir, self._stop, send), daemon=True)
        self._process.start()
        if not self._receive.poll(60):
            raise RuntimeError("the segment witness did not start")
        self._receive.recv()
        self.evicted: list[str] = []

    def __enter__(self) -> _Witness:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.evicted = self._receive.recv() if self._receive.poll(60) else []
        self._process.join(10)


def _witness_main(cache_dir: Path, stop: Any, send: Any) -> None:
    with SegmentWitness(cache_dir) as witness:
        send.send("ready")
        stop.wait()
    send.send(witness.evicted_keys())


def run(work: Path, remote: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    sample_bytes = args.sample_kib << 10
    cap = int(args.rate / 3 * sample_bytes) if name == "remote at a third" else 0
    cache_dir = work / f"cache-{RUNS.index(name)}"
    document = {
        "remote": {"url": f"file://{remote}", "refresh_interval": "60s", "max_bytes_per_s": cap},
        "cache": {
            "dir": str(cache_dir),
            "max_bytes": int(args.samples * sample_bytes * args.budget),
            "min_free_bytes": 0,
            "segment_bytes": "256KiB",
            "fsync": False,
            **({"turnover": args.turnover} if args.turnover else {}),
        },
        "sampler": {"processes": 2, "concurrency": 4, "decode": "msgpack"},
        "status": {"interval": "200ms"},
    }
    config = work / f"{cache_dir.name}.toml"
    config.write_text(toml_text(document))
    witness = _Witness(cache_dir)  # before the daemon: it sees every segment
    proc = start_daemon(config, cache_dir, work / f"{cache_dir.name}.stderr")
    served, waits, bounds = Served(), [], []
    step_s = BATCH / args.rate
    samples = args.samples * (args.capped_passes if cap else 1)
    with witness:
        try:
            with EpochLoaderFactory(cache_dir, batch_size=BATCH, num_workers=2, run_id="echo", progress=None) as f:
                started = time.perf_counter()
                while sum(len(keys) for keys in served.epochs) < samples:
                    epoch = len(served.epochs)
                    keys: list[str] = []
                    due = time.perf_counter()
                    for batch in f.loader(epoch):
                        # the training step: busy, as a GPU's launches are, until the batch's slot at --rate ends
                        # (the time next() took is part of the slot; a late batch starts a new slot, no catch-up)
                        due = max(due + step_s, time.perf_counter())
                        keys += sample_keys(batch)
                        while time.perf_counter() < due:
                            pass
                    served.epoch(keys)
                    during = proc.status()  # while training runs (once it stops, a full cache paces ingest)
                    bounds.append(during["cache"].get("ingest_bound") if during else None)
                    wait = f.stats(epoch).handover_wait_s if epoch else None
                    if wait is not None:
                        waits.append(wait)
                trained_s = time.perf_counter() - started
            status = final_status(proc, len(served.epochs))
        finally:
            proc.stop()
    total = sum(len(keys) for keys in served.epochs)
    times = served.times()
    first: dict[str, int] = {}
    for number, keys in enumerate(served.epochs):
        for key in keys:
            first.setdefault(key, number)
    settled = [times[key] for key in set(witness.evicted) if first.get(key, -1) >= WARM_EPOCHS]
    return {
        "run": name,
        "remote_cap_bytes_per_s": cap,
        "epochs": len(served.epochs),
        "samples_served": total,
        "samples_per_s": total / trained_s,  # training's real rate (below --rate where the loader made it wait)
        "distinct_samples": len(times),
        "distinct_share": len(times) / total if total else None,
        "reads_per_sample": total / len(times) if times else None,
        "lifetime_reads_per_sample": statistics.fmean(settled) if settled else None,
        "lifetime_samples": len(settled),
        "handover_wait_max_s": max(waits, default=None),
        "handover_wait_median_s": statistics.median(waits) if waits else None,
        "status_echo_factor": status["cache"].get("echo_factor"),
        # what status said at the end of each epoch after the warm-up (the last complete epoch and the current one)
        "status_ingest_bound": sorted({b or "-" for b in bounds[WARM_EPOCHS:]}),
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| run | epochs | samples served | samples/s | distinct | reads per sample (served / lifetime) "
        "| handover wait (median / max) | status: echo factor, ingest |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        median, top = row["handover_wait_median_s"], row["handover_wait_max_s"]
        lines.append(
            f"| {row['run']} | {row['epochs']} | {row['samples_served']:,} | {row['samples_per_s']:,.0f} "
            f"| {dash(row['distinct_share'], '.0%')} "
            f"| {dash(row['reads_per_sample'], '.2f')} / {dash(row['lifetime_reads_per_sample'], '.2f')} "
            f"| {dash(median and median * 1e3, '.1f')} / {dash(top and top * 1e3, '.1f')} ms "
            f"| {dash(row['status_echo_factor'], '.2f')}, {' then '.join(row['status_ingest_bound']) or '-'} |"
        )
    return lines


def readme_table(doc: dict[str, Any]) -> str:
    """The README's echo table, from a committed result document."""
    figures = doc["figures"]
    intro = (
        f"{figures['samples']:,} samples of {figures['sample_kib']} KiB on a `file://` remote on tmpfs, a cache of "
        f"{figures['budget']:.0%} of them, training at {figures['rate']:g} samples/s (nominal) for one pass's worth "
        f"of samples ({figures['capped_passes']} with the capped remote):"
    )
    return readme_block(intro, table(figures["rows"]), doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--sample-kib", type=int, default=16)
    parser.add_argument("--budget", type=float, default=0.3, help="the cache's budget, a fraction of the dataset")
    parser.add_argument("--rate", type=float, default=800.0, help="training's samples per second")
    parser.add_argument("--capped-passes", type=int, default=3, help="passes' worth trained with the capped remote")
    parser.add_argument("--turnover", help='cache.turnover ("50%%"); the daemon\'s default if not given')
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=RUNS)
    parser.add_argument("--no-save", dest="save", action="store_false")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cachefeed-echo-", dir="/dev/shm") as tmp:
        work = Path(tmp)
        remote = make_remote(work / "data", args.samples, args.sample_kib << 10)
        for name in args.runs:
            row = run(work, remote, name, args)
            rows.append(row)
            print(table([row])[-1], flush=True)
        figures = {
            "samples": args.samples,
            "sample_kib": args.sample_kib,
            "budget": args.budget,
            "rate": args.rate,
            "capped_passes": args.capped_passes,
            "turnover": args.turnover,
            "rows": rows,
        }
        print("\n".join(table(rows)))
        if args.save:
            print(f"results: {save('echo', figures, work_dir=Path(tmp))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
