"""Egress per trained sample: what the daemon downloads for what training reads, paced against free-running.

    python -m benchmarks.egress [--objects 300] [--object-kib 64] [--budget-mib 8] [--seconds 15] [--slow-step 1]

One moto S3 server behind a counting proxy (GETs counted at the server side of the daemon), one dataset of
``--objects`` .npy objects, a cache budget of about a third of it. Three trainers, each for ``--seconds``:

* ``no trainer``: nothing reads;
* ``slow trainer``: a step of ``--slow-step`` (1 s) per batch of 16, 16 samples/s (training slower than the remote:
  moto behind the counting proxy serves a few dozen 64 KiB objects per second on 2 shared cores);
* ``fast trainer``: no step, the remote capped at 2 MiB/s with ``remote.max_bytes_per_s`` (training faster);
* ``tenth epochs``: no step, epochs of ``samples_per_epoch`` = a tenth of what the cache holds (an epoch serves
  part of its snapshot: the case where crediting whole snapshots evicted samples never served);

each with ``cache.evict_after_reads = 1`` (paced, the default) and ``0`` (free-running, the old behaviour).
Printed per run: remote bytes and GETs per sample the training loop received ("trained": counted from the batches
themselves), bytes downloaded per byte trained, samples evicted unread as status says and as a witness counts (the
keys of every segment file the daemon published and then removed, against the keys the loop received:
``cachefeed/_testing/witness.py``), and the reads per evicted sample. Writes ``benchmarks/results/egress.json``
(``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import dash, readme_block, save
from cachefeed._testing.daemon import BUCKET, start_daemon, write_config
from cachefeed._testing.local_s3 import DUMMY_ENV, LocalS3
from cachefeed._testing.proxy import FaultProxy
from cachefeed._testing.samples import upload_arrays
from cachefeed._testing.witness import SegmentWitness, Served, final_status, sample_keys
from cachefeed._trainer import EpochLoaderFactory

TRAINERS = ("no trainer", "slow trainer", "fast trainer", "tenth epochs")


def run(server: LocalS3, work: Path, trainer: str, reads: int, args: argparse.Namespace) -> dict[str, Any]:
    cache_dir = work / f"cache-{trainer.replace(' ', '-')}-{reads}"
    sections: dict[str, dict[str, Any]] = {
        "cache": {"max_bytes": args.budget_mib << 20, "evict_after_reads": reads},
        "status": {"interval": "200ms"},
    }
    if trainer == "fast trainer":
        sections["remote"] = {"max_bytes_per_s": 2 << 20}
    with FaultProxy(server.endpoint) as proxy:
        config = write_config(
            work / f"{cache_dir.name}.toml",
            endpoint=proxy.endpoint,
            bucket=BUCKET,
            cache_dir=cache_dir,
            sections=sections,
        )
        proc = start_daemon(config, cache_dir, work / f"{cache_dir.name}.stderr")
        served = Served()
        witness = SegmentWitness(cache_dir).__enter__()
        try:
            deadline = time.monotonic() + args.seconds
            if trainer == "no trainer":
                time.sleep(args.seconds)
            else:
                step_s = args.slow_step if trainer == "slow trainer" else 0.0
                options: dict[str, Any] = {"batch_size": 16, "min_samples": 16}
                if trainer == "tenth epochs":
                    full = proc.wait_status(lambda d: d["cache"]["fill"] >= 0.9, timeout_s=60, what="a full cache")
                    tenth = max(1, full["cache"]["samples"] // 10)
                    options = {"batch_size": min(16, tenth), "samples_per_epoch": tenth, "min_samples": tenth}
                    deadline = time.monotonic() + args.seconds  # the fill is not part of the run
                with EpochLoaderFactory(cache_dir, run_id="egress", progress=None, **options) as factory:
                    while time.monotonic() < deadline:
                        keys: list[str] = []
                        for batch in factory.loader(len(served.epochs)):
                            keys += sample_keys(batch)
                            time.sleep(step_s)
                        served.epoch(keys)
            doc = final_status(proc, len(served.epochs))
        finally:
            proc.stop()
            witness.stop()
        gets = proxy.counts().ops.get("GetObject", 0)
    downloaded = doc["remote"]["bytes_total"]
    trained = sum(len(keys) for keys in served.epochs)
    times = served.times()
    return {
        "trainer": trainer,
        "evict_after_reads": reads,
        "seconds": args.seconds,
        "epochs": len(served.epochs),
        "samples_trained": trained,
        "gets": gets,
        "bytes_downloaded": downloaded,
        "bytes_per_trained_sample": downloaded / trained if trained else None,
        "bytes_per_trained_byte": downloaded / (trained * (args.object_kib << 10)) if trained else None,
        "gets_per_trained_sample": gets / trained if trained else None,
        "evicted_samples": doc["evicted"]["samples_total"],
        "evicted_unread_samples": doc["evicted"]["unread_samples_total"],
        "witness_evicted_unread_samples": sum(1 for key in witness.evicted_keys() if not times[key]),
        # keys cached more than once (a later pass over the remote): the witness names a sample by its key, so
        # where this is > 0 it cannot tell which copy was served, and may count fewer evicted unread than status
        "witness_repeated_keys": witness.repeated_keys(),
        "reads_per_evicted_sample": doc["evicted"]["epochs_per_sample"],
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| trainer | evict_after_reads | samples trained | GETs | MiB downloaded | bytes / trained byte "
        "| GETs / trained sample | evicted unread (status / witness) | keys cached twice | reads per evicted sample |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['trainer']} | {row['evict_after_reads']} | {row['samples_trained']:,} | {row['gets']:,} "
            f"| {row['bytes_downloaded'] / (1 << 20):,.1f} | {dash(row.get('bytes_per_trained_byte'), '.2f')} "
            f"| {dash(row['gets_per_trained_sample'], '.2f')} | {row['evicted_unread_samples']:,} / "
            f"{dash(row.get('witness_evicted_unread_samples'), ',')} | {dash(row.get('witness_repeated_keys'), ',')} "
            f"| {dash(row['reads_per_evicted_sample'], '.2f')} |"
        )
    return lines


def readme_table(doc: dict[str, Any]) -> str:
    """The README's egress table, from a committed result document."""
    figures = doc["figures"]
    intro = (
        f"{figures['objects']} objects of {figures['object_kib']} KiB, a {figures['budget_mib']} MiB cache, "
        f"{figures['seconds']:g} s per run:"
    )
    return readme_block(intro, table(figures["rows"]), doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=300)
    parser.add_argument("--object-kib", type=int, default=64)
    parser.add_argument("--budget-mib", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--slow-step", type=float, default=1.0, help="the slow trainer's step per batch of 16 (s)")
    parser.add_argument("--no-save", dest="save", action="store_false")
    args = parser.parse_args(argv)
    os.environ.update(DUMMY_ENV)
    server = LocalS3.start()
    rows = []
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        upload_arrays(client, BUCKET, args.objects, args.object_kib << 10)
        with tempfile.TemporaryDirectory(prefix="cachefeed-egress-", dir="/dev/shm") as tmp:
            for trainer in TRAINERS:
                for reads in (1, 0):
                    row = run(server, Path(tmp), trainer, reads, args)
                    rows.append(row)
                    print(table([row])[-1], flush=True)
            figures = {
                "objects": args.objects,
                "object_kib": args.object_kib,
                "budget_mib": args.budget_mib,
                "seconds": args.seconds,
                "rows": rows,
            }
            print("\n".join(table(rows)))
            if args.save:
                print(f"results: {save('egress', figures, work_dir=Path(tmp))}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
