"""Ingest rate of the daemon next to a plain concurrent download of the same objects from the same server.

    python -m benchmarks.ingest [--small N] [--large N] [--processes 2] [--concurrency 16] [--repeat 2] [--md5-off]

One moto S3 server (a subprocess, in-memory) serves both contenders in the same run, one after the other:

* **plain**: one asyncio process, s3fs/aiobotocore ``get_object`` calls with ``processes x concurrency``
  requests in flight, bodies read whole and dropped: the most a client can pull from this server.
* **daemon**: ``cachefeed daemon`` (its sampler subprocesses fetch, decode ``.npy``, write and publish segments
  into a tmpfs cache big enough for the whole set), timed from the moment the listing joins pass 0 to the moment
  pass 0 completes (every object's samples published), from the daemon's own log timestamps. The daemon is warm
  (samplers started, HTTP clients built) before the objects appear: it starts on an empty prefix, the objects
  are copied there server-side, and SIGHUP makes it list them.

With ``--md5-off`` a third contender runs in the same run: the daemon with ``remote.verify_md5 = false``, which
shows what checking each body against its MD5 ETag costs.

Listing is outside both timings. Each contender runs ``--repeat`` times per object size, alternating; the best
run of each is reported (best-of is the usual way to take scheduler noise out of a shared machine's figures).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common.results import provenance_line, save
from benchmarks.common.s3server import delete_prefix
from cachefeed._testing.daemon import start_daemon, wait_for, write_config
from cachefeed._testing.local_s3 import DUMMY_ENV, LocalS3
from cachefeed._testing.samples import npy_bytes

BUCKET = "bench"
_STAMP = re.compile(r"^(\S+) INFO cachefeed\.daemon\.(?:supervisor|plan)\[\d+\]: (.*)$")


def upload(server: LocalS3, prefix: str, count: int, nbytes: int) -> int:
    client = server.client()
    rng = np.random.default_rng(0)
    body = npy_bytes(rng.integers(0, 256, size=nbytes, dtype=np.uint8))
    for i in range(count):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/obj-{i:06d}.npy", Body=body)
    return len(body)


async def plain_download(server: LocalS3, prefix: str, in_flight: int) -> tuple[float, int, int]:
    """Seconds, objects and bytes for fetching every object under ``prefix`` once."""
    import s3fs

    fs = s3fs.S3FileSystem(
        asynchronous=True,
        skip_instance_cache=True,
        config_kwargs={"max_pool_connections": in_flight},
        **server.storage_options(),
    )
    await fs.set_session()
    keys = [path.split("/", 1)[1] for path in await fs._find(f"{BUCKET}/{prefix}")]
    client = await fs.get_s3(BUCKET)
    gate = asyncio.Semaphore(in_flight)
    total = 0

    async def get(key: str) -> None:
        nonlocal total
        async with gate:
            response = await client.get_object(Bucket=BUCKET, Key=key)
            async with response["Body"] as stream:
                body = await stream.read()
            total += len(body)

    started = time.perf_counter()
    await asyncio.gather(*(get(key) for key in keys))
    elapsed = time.perf_counter() - started
    await fs._s3creator.__aexit__(None, None, None)
    return elapsed, len(keys), total


def _log_time(line: str) -> float:
    return datetime.fromisoformat(line.split(" ", 1)[0]).timestamp()


def daemon_ingest(
    server: LocalS3,
    source: str,
    run: str,
    count: int,
    dataset_bytes: int,
    processes: int,
    concurrency: int,
    work: Path,
    verify_md5: bool = True,
) -> tuple[float, dict[str, Any]]:
    """Seconds from "objects join pass 0" to "pass 0 completed", and the final status document.

    The daemon starts on the empty prefix ``run``; once its samplers are up (their HTTP clients built), the objects
    of ``source`` are copied under ``run`` and SIGHUP makes the daemon list them: the timing sees a warm daemon,
    as the plain download sees a warm client.
    """
    cache_dir = Path(tempfile.mkdtemp(prefix="cachefeed-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        segment_bytes = 16 << 20
        max_bytes = max(2 * dataset_bytes, 8 * segment_bytes) + (64 << 20)
        config = write_config(
            work / f"{run}.toml",
            endpoint=server.endpoint,
            bucket=BUCKET,
            prefix=run + "/",
            cache_dir=cache_dir / "cache",
            sections={
                "remote": {"refresh_interval": "1h", "verify_md5": verify_md5},
                "cache": {"max_bytes": max_bytes, "segment_bytes": segment_bytes},
                "sampler": {"processes": processes, "concurrency": concurrency},
                "status": {"interval": "500ms"},
                "log": {"level": os.environ.get("BENCH_LOG", "info")},
            },
        )
        stderr = work / f"{run}.stderr"
        proc = start_daemon(config, cache_dir / "cache", stderr)
        try:
            proc.wait_status(
                lambda d: all(s["state"] == "running" for s in d["samplers"]), timeout_s=60, what="samplers up"
            )
            client = server.client()
            for i in range(count):
                client.copy_object(
                    Bucket=BUCKET,
                    Key=f"{run}/obj-{i:06d}.npy",
                    CopySource={"Bucket": BUCKET, "Key": f"{source}/obj-{i:06d}.npy"},
                )
            proc.signal(signal.SIGHUP)
            doc = proc.wait_status(
                lambda d: d["ingest"]["objects_total"] >= count, timeout_s=600, what=f"{count} objects ingested"
            )
            wait_for(lambda: "pass 0 completed" in proc.stderr(), timeout_s=60, what="pass 0 completed")
        finally:
            proc.stop()
        start = end = 0.0
        for line in proc.stderr().splitlines():
            match = _STAMP.match(line)
            if match and "join pass 0" in match.group(2):
                start = _log_time(line)
            elif match and match.group(2).startswith("pass 0 completed"):
                end = _log_time(line)
        if not (start and end):
            raise RuntimeError(f"could not find the pass 0 timestamps in {stderr}")
        return end - start, doc
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        delete_prefix(server.client(), BUCKET, run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=3000, help="number of 4 KiB objects (3000)")
    parser.add_argument("--large", type=int, default=400, help="number of 1.5 MiB objects (400)")
    parser.add_argument("--processes", type=int, default=2, help="sampler processes (2)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per sampler (16)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each contender per size (3)")
    parser.add_argument("--md5-off", action="store_true", help="also run the daemon with remote.verify_md5 = false")
    parser.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/ingest.json")
    args = parser.parse_args(argv)
    os.environ.update(DUMMY_ENV)
    in_flight = args.processes * args.concurrency
    work = Path(tempfile.mkdtemp(prefix="cachefeed-ingest-"))
    server = LocalS3.start()
    rows = []
    try:
        server.client().create_bucket(Bucket=BUCKET)
        for label, count, nbytes in (("4KiB", args.small, 4 << 10), ("1.5MiB", args.large, 3 << 19)):
            if count <= 0:
                continue
            object_bytes = upload(server, label, count, nbytes)
            dataset = count * object_bytes
            plain: list[float] = []
            daemon: list[float] = []
            unverified: list[float] = []
            for k in range(args.repeat):
                seconds, n, total = asyncio.run(plain_download(server, label, in_flight))
                if n != count or total != dataset:
                    raise RuntimeError(f"plain download got {n} objects / {total} bytes")
                plain.append(seconds)
                seconds, doc = daemon_ingest(
                    server, label, f"{label}-run{k}", count, dataset, args.processes, args.concurrency, work
                )
                if doc["remote"]["errors_total"]:
                    raise RuntimeError(f"the daemon saw remote errors: {doc['remote']['errors_by_kind']}")
                daemon.append(seconds)
                if args.md5_off:
                    seconds, _doc = daemon_ingest(
                        server,
                        label,
                        f"{label}-nomd5-{k}",
                        count,
                        dataset,
                        args.processes,
                        args.concurrency,
                        work,
                        verify_md5=False,
                    )
                    unverified.append(seconds)
            best_plain, best_daemon = min(plain), min(daemon)
            rows.append((label, count, dataset, best_plain, best_daemon, plain, daemon, unverified))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"moto S3 on loopback, {args.processes} samplers x {args.concurrency} in flight "
        f"(plain: {in_flight} in flight in one process), best of {args.repeat}"
    )
    print(f"{'objects':>8} {'size':>7} | {'plain obj/s':>11} {'MiB/s':>7} | {'daemon obj/s':>12} {'MiB/s':>7} | ratio")
    for label, count, dataset, best_plain, best_daemon, _plain, _daemon, unverified in rows:
        print(
            f"{count:>8} {label:>7} | {count / best_plain:>11.0f} {dataset / best_plain / 2**20:>7.1f} | "
            f"{count / best_daemon:>12.0f} {dataset / best_daemon / 2**20:>7.1f} | {best_plain / best_daemon:5.2f}"
        )
        if unverified:
            best = min(unverified)
            print(
                f"{'':>8} {'':>7} | verify_md5 = false: {count / best:>8.0f} obj/s {dataset / best / 2**20:>7.1f} MiB/s"
                f" | {best_plain / best:5.2f} (MD5 check costs {best_daemon / best - 1:+.0%} of the ingest time)"
            )
    for label, _count, _dataset, _bp, _bd, plain, daemon, unverified in rows:
        print(f"  {label}: plain runs {[f'{s:.2f}s' for s in plain]}, daemon runs {[f'{s:.2f}s' for s in daemon]}")
        if unverified:
            print(f"  {label}: verify_md5 = false runs {[f'{s:.2f}s' for s in unverified]}")
    if not args.no_save:
        figures = {
            "processes": args.processes,
            "concurrency": args.concurrency,
            "repeat": args.repeat,
            "rows": [
                {
                    "objects": label,
                    "count": count,
                    "dataset_bytes": dataset,
                    "plain_runs_s": [round(x, 3) for x in plain],
                    "daemon_runs_s": [round(x, 3) for x in daemon],
                    "daemon_no_md5_runs_s": [round(x, 3) for x in unverified],
                }
                for label, count, dataset, _bp, _bd, plain, daemon, unverified in rows
            ],
        }
        print(f"wrote {save('ingest', figures, work_dir=Path(tempfile.gettempdir()))}")
    return 0


def readme_table(doc: dict[str, Any]) -> str:
    """The README's ingest table, from a committed result document: the best run of each, as ``main`` prints."""
    figures = doc["figures"]
    lines = [
        f"The daemon ({figures['processes']} samplers x {figures['concurrency']} requests in flight) against a plain "
        f"download of the same objects with as many requests in flight in one process, moto's S3 server on "
        f"loopback sharing the machine, best of {figures['repeat']} runs each:",
        "",
        "| objects | plain download | daemon, MD5 checked | of the plain download | daemon, `verify_md5 = false` "
        "| of the plain download |",
        "|---|---|---|---|---|---|",
    ]
    for row in figures["rows"]:
        count, mib = row["count"], row["dataset_bytes"] / 2**20
        plain, daemon = min(row["plain_runs_s"]), min(row["daemon_runs_s"])
        cells = [
            f"{count / plain:,.0f} obj/s, {mib / plain:.1f} MiB/s",
            f"{count / daemon:,.0f} obj/s",
            f"{plain / daemon:.2f}x",
        ]
        if row["daemon_no_md5_runs_s"]:
            bare = min(row["daemon_no_md5_runs_s"])
            cells += [f"{count / bare:,.0f} obj/s", f"{plain / bare:.2f}x"]
        else:
            cells += ["-", "-"]
        lines.append(f"| {count:,} x {row['objects']} | " + " | ".join(cells) + " |")
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
