"""A cold start: time from the daemon's start to the first batch, and to the end of the first epoch.

    python -m benchmarks.first_batch [--objects 100] [--per-object 20] [--sample-kib 16] [--fill-s 20]

A ``file://`` remote on /dev/shm of ``--objects`` msgpack objects (``--per-object`` samples of ``--sample-kib``
each), read through ``remote.max_bytes_per_s`` set so that fetching it all takes ``--fill-s`` seconds; a budget the
whole dataset fits in. A trainer (``num_workers=2``, batch 64) is started with the daemon, twice:

* ``growing`` (the default, ``min_samples`` unset): the first epoch starts when each worker has a segment and
  takes segments as they are published (NOTE [ Growing snapshots ] in ``cachefeed/_trainer/growing.py``);
* ``75% fill`` (``min_samples="75%"``, the default before): the first epoch waits for the fill, then reads what is
  cached.

Printed per mode: seconds from the daemon's start to the first batch and to the end of epoch 0, and the samples
epoch 0 served (counted from the batches). Writes ``benchmarks/results/first_batch.json`` (``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from benchmarks.common.machine import byte_compile_cachefeed
from benchmarks.common.results import readme_block, save
from cachefeed._codecs import msgpack_default
from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._testing.samples import payload
from cachefeed._testing.witness import sample_keys
from cachefeed._trainer import EpochLoaderFactory

MODES: dict[str, dict[str, Any]] = {"growing": {}, "75% fill": {"min_samples": "75%"}}


def make_remote(root: Path, args: argparse.Namespace) -> int:
    root.mkdir(parents=True)
    nbytes = 0
    for obj in range(args.objects):
        samples = [{"data": payload(f"{obj}/{i}", args.sample_kib << 10)} for i in range(args.per_object)]
        blob = msgpack.packb(samples, default=msgpack_default)
        (root / f"obj-{obj:05d}.msgpack").write_bytes(blob)
        nbytes += len(blob)
    return nbytes


def run(work: Path, remote: Path, mode: str, rate: int, args: argparse.Namespace) -> dict[str, Any]:
    cache_dir = work / f"cache-{mode.replace(' ', '').replace('%', '')}"  # removed with ``work`` (RAM on tmpfs)
    document = {
        "remote": {"url": f"file://{remote}", "refresh_interval": "60s", "max_bytes_per_s": rate},
        "cache": {"dir": str(cache_dir), "max_bytes": "1GiB", "min_free_bytes": 0, "fsync": False},
        "sampler": {"processes": 2, "concurrency": 4, "decode": "msgpack"},
        "status": {"interval": "100ms"},
    }
    config = work / f"{cache_dir.name}.toml"
    config.write_text(toml_text(document))
    started = time.perf_counter()
    daemon = start_daemon(config, cache_dir, work / f"{cache_dir.name}.stderr")
    first_batch = None
    served = 0
    try:
        with EpochLoaderFactory(
            cache_dir, batch_size=64, num_workers=2, run_id="cold", progress=None, epochs=1, **MODES[mode]
        ) as factory:
            for batch in factory.loader(0):
                if first_batch is None:
                    first_batch = time.perf_counter() - started
                served += len(sample_keys(batch))
        epoch_end = time.perf_counter() - started
    finally:
        daemon.stop()
    return {
        "mode": mode,
        "first_batch_s": round(first_batch or 0.0, 2),
        "first_epoch_s": round(epoch_end, 2),
        "served": served,
    }


def readme_table(doc: dict[str, Any]) -> str:
    figures = doc["figures"]
    intro = (
        f"A cold start: the remote capped so that fetching all {figures['samples']:,} samples takes "
        f"{figures['fill_s']:g} s (file:// on tmpfs, the whole dataset fits the budget), a trainer with 2 workers "
        "started with the daemon."
    )
    rows = ["| first epoch | first batch | end of epoch 0 | samples in epoch 0 |", "|---|---|---|---|"]
    rows += [
        f"| {row['mode']} | {row['first_batch_s']:.2f} s | {row['first_epoch_s']:.1f} s | {row['served']:,} |"
        for row in figures["rows"]
    ]
    return readme_block(intro, rows, doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100)
    parser.add_argument("--per-object", type=int, default=20)
    parser.add_argument("--sample-kib", type=int, default=16)
    parser.add_argument("--fill-s", type=float, default=20.0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    byte_compile_cachefeed()  # the daemon's start loads .pyc files, as an installed package's does
    with tempfile.TemporaryDirectory(prefix="cf-first-batch-", dir="/dev/shm") as tmp:
        work = Path(tmp)
        nbytes = make_remote(work / "remote", args)
        rate = max(1, int(nbytes / args.fill_s))
        rows = []
        for mode in MODES:
            row = run(work, work / "remote", mode, rate, args)
            rows.append(row)
            print(
                f"{mode:>10}: first batch {row['first_batch_s']:.2f} s, end of epoch 0 {row['first_epoch_s']:.1f} s, "
                f"{row['served']} samples",
                flush=True,
            )
        figures = {"samples": args.objects * args.per_object, "fill_s": args.fill_s, "rows": rows}
        if not args.no_save:
            print(f"results: {save('first_batch', figures, work_dir=work)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
