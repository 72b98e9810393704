"""What the daemon's start pays for its S3 session, and a forked sampler's first GET, in CPU.

    python -m benchmarks.first_request [--rounds 8] [--object-kib 1700] [--no-save]

One object (a tar shard's size by default) on a local moto server. Each round is a fresh interpreter that does what
the daemon's start does: it warms the S3 session (``Remote.warm_session``, in the supervisor: botocore loads its
models and the TLS context is built), then forks a "sampler" that makes its own ``Remote`` and GETs the object
twice. The figures are CPU seconds (``time.process_time``: every thread, so aiobotocore's TLS build on its worker
thread counts): the warm-up, and the sampler's first GET and second. Three modes, alternated round by round:

* ``shared``: cachefeed's default;
* ``per client``: aiobotocore's own session class (``config_kwargs.http_session_cls``), which builds a TLS context
  and loads the CA bundle for every client, as cachefeed did before 0d66a55 (NOTE [ One TLS context ] in
  ``cachefeed/_remote/tls.py``);
* ``botocore loader``: the warmed session with botocore's own data loader, as before this benchmark's third mode
  (NOTE [ botocore's models, loaded once and plainly ] in ``cachefeed/_remote/models.py``).

The endpoint is http: the context is built all the same (that is the cost measured), and never used. Prints the
median of the rounds per mode and writes ``benchmarks/results/first_request.json`` (``--no-save`` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import save

BUCKET = "bench"
KEY = "shard-000000.tar"
MODES = ("shared", "per client", "botocore loader")


def one_round(mode: str, endpoint: str, size: int, etag: str) -> dict[str, float]:
    """In a fresh interpreter: warm as the supervisor does, fork a sampler, time its two GETs (CPU seconds). The
    modules are imported before any clock starts, in every mode alike: the figures are the session's and the
    clients' own costs."""
    import s3fs  # noqa: F401  (imported, not timed)
    from aiobotocore.httpsession import AIOHTTPSession
    from aiobotocore.session import AioSession

    from cachefeed._config import RemoteConfig
    from cachefeed._remote import Remote, RemoteObject, models, tls  # noqa: F401  (tls: imported, not timed)
    from cachefeed._testing.local_s3 import storage_options

    options: dict[str, Any] = storage_options(endpoint)
    if mode == "per client":
        options["config_kwargs"] = {"http_session_cls": AIOHTTPSession}
    if mode == "botocore loader":
        models.session = AioSession  # what ``Remote.warm_session`` makes its session with
    config = RemoteConfig(url=f"s3://{BUCKET}/", storage_options=options)
    started = time.process_time()
    Remote(config).warm_session()
    warm_cpu = time.process_time() - started
    obj = RemoteObject(f"{BUCKET}/{KEY}", size, etag)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            sampler = Remote(config)

            async def fetch_twice() -> list[float]:
                cpu = []
                for _ in range(2):
                    started = time.process_time()
                    await sampler.fetch(obj)
                    cpu.append(time.process_time() - started)
                await sampler.aclose()
                return cpu

            first, second = asyncio.run(fetch_twice())
            found = {"warm_session_cpu_s": warm_cpu, "first_get_cpu_s": first, "second_get_cpu_s": second}
            os.write(write_end, json.dumps(found).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        found: dict[str, float] = json.loads(pipe.read())
    os.waitpid(pid, 0)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--object-kib", type=int, default=1700)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--round", nargs=4, metavar=("MODE", "ENDPOINT", "SIZE", "ETAG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.round:
        mode, endpoint, size, etag = args.round
        print(json.dumps(one_round(mode, endpoint, int(size), etag)))
        return 0

    from cachefeed._testing.local_s3 import DUMMY_ENV, LocalS3

    server = LocalS3.start()
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=KEY, Body=os.urandom(args.object_kib << 10))
        etag = client.head_object(Bucket=BUCKET, Key=KEY)["ETag"]
        env = {**os.environ, **DUMMY_ENV}
        rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                command = ["--round", mode, server.endpoint, str(args.object_kib << 10), etag]
                done = subprocess.run(
                    [sys.executable, "-m", "benchmarks.first_request", *command],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rounds[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        server.stop()
    figures: dict[str, Any] = {"rounds": args.rounds, "object_bytes": args.object_kib << 10}
    for mode in MODES:
        warm, first, second = (
            statistics.median(r[key] for r in rounds[mode])
            for key in ("warm_session_cpu_s", "first_get_cpu_s", "second_get_cpu_s")
        )
        figures[mode] = {
            "warm_session_cpu_s": round(warm, 4),
            "first_get_cpu_s": round(first, 4),
            "second_get_cpu_s": round(second, 4),
        }
        print(
            f"{mode:15}  the supervisor's warm-up {warm * 1000:6.1f} ms of CPU; a forked sampler's first GET "
            f"{first * 1000:6.1f} ms, its second {second * 1000:5.1f}"
        )
    if not args.no_save:
        with tempfile.TemporaryDirectory() as work:
            print("wrote", save("first_request", figures, work_dir=Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
