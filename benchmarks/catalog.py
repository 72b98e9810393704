"""The catalog at scale: memory per object, time to the first fetch, LIST requests per node per hour, restarts.

    python -m benchmarks.catalog [--sizes 100000 1000000 10000000] [--nodes 1 100 1000] [--long-keys 10000000]
                                 [--s3 100000] [--jobs 4]

A synthetic dataset (``--sizes`` keys of 42 to 43 bytes, ``<root>/class-NNNNN/<name>.jpg``, 1,000 per directory)
is served by an in-process fsspec filesystem (``SyntheticFS``) that answers one ``ls`` per directory: one LIST
request of 1,000 keys, counted. Each size runs in a fresh process, through the daemon's own listing code
(``Catalog``: the paged listing, folding in the listing thread) and plan (``SamplingPlan``), driven as the
supervisor drives them (pages taken as they come, ``update_page``, ``end_listing``), and reports:

* ``rss_per_object``: the process's peak RSS over its RSS before listing, per listed object (node 0 of 1), the
  peak covering the listing, writing the restart catalog (``restart_save_s``) and laying out a pass over every
  object, as the daemon does after a listing (with the allocator set as the supervisor sets it,
  ``columns.return_freed_memory``); and ``plan_bytes_per_object``: what the plan's columns hold
  (``SamplingPlan.nbytes``), per owned object. Keys are 43 bytes (``key_bytes_per_owned``): a catalog of longer
  keys costs their extra bytes per object on top;
* ``first_fetch_s``: from the start of the listing to the first object the plan hands out (the supervisor sends
  it to a sampler at once), and ``listing_s``: to the end of the listing;
* ``restart_first_fetch_s``: from reading the restart catalog (``catalog_file``, written after the listing) to
  the first object handed out: what a restarted daemon waits;
* per node count in ``--nodes``: the RSS per node owning ``1/count`` (measured for 100 nodes, the largest size
  that ran), and LIST requests per node per hour: each node lists everything every refresh interval (the default
  5 minutes, never under 10 times the listing's duration, as ``Catalog`` does), or none with a manifest or a
  shared catalog (one listing per interval for the whole job, by the lister). Nodes beyond the one measured are
  simulated by that same arithmetic (every node's listing costs the same requests).

``--long-keys`` sizes are measured again (node 0 of 1) with every key padded to ``--long-key-bytes`` (80) bytes.
``--s3 N`` (default 10⁵; 0 skips it): a bucket of N objects on the local S3 server, read by a real daemon and then
restarted on its cache (``measure_s3``): seconds from the daemon's start to its first LIST and first object GET (at
the server), LIST requests, the supervisor's peak RSS. ``--jobs``: measurements run at once (each in a process of
its own: times are longer, memory is not shared).

What it does not measure: the samplers' downloads (the first fetch is the plan handing out its first object), and
a real S3 server's listing speed (the synthetic filesystem answers at memory speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import fsspec
from fsspec.spec import AbstractFileSystem

from benchmarks.common.results import provenance_line, save

PER_DIR = 1000
DEFAULT_REFRESH_S = 300.0
COST_FACTOR = 10.0


class SyntheticFS(AbstractFileSystem):
    """``synthetic://<n>`` (or ``<n>x<key bytes>``: names padded to keys of that length): n keys, 1,000 per
    directory, generated on demand; every ``ls`` is counted."""

    protocol = "synthetic"
    root_marker = ""
    requests: ClassVar[int] = 0

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        SyntheticFS.requests += 1
        path = self._strip_protocol(path).strip("/")
        parts = path.split("/")
        total_text, _, key_bytes = parts[0].partition("x")
        total = int(total_text)
        if len(parts) == 1:
            dirs = math.ceil(total / PER_DIR)
            return [{"name": f"{parts[0]}/class-{d:05d}", "type": "directory", "size": 0} for d in range(dirs)]
        pad = max(0, int(key_bytes or 0) - len(f"{path}/n000000000_0000000.jpg"))
        d = int(parts[1].removeprefix("class-"))
        start, stop = d * PER_DIR, min(total, (d + 1) * PER_DIR)
        return [
            {
                "name": f"{path}/n{i:09d}_{i * 2654435761 % 1000003:07d}{'_' * pad}.jpg",
                "type": "file",
                "size": 1000 + i % 50000,
                "ETag": f'"{i:032x}"',
            }
            for i in range(start, stop)
        ]


fsspec.register_implementation("synthetic", SyntheticFS, clobber=True)


def _rss_mb(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def measure_one(size: int, rank: int, count: int, work: Path, key_bytes: int = 0) -> dict[str, Any]:
    """One size in this process (see the module docstring). The pass is laid out while the plan still holds the
    listing's pass-0 queue (4 bytes per object), which a daemon has emptied by the time it lays out a pass: the peak
    is over by that much."""
    from cachefeed._config import RemoteConfig
    from cachefeed._daemon.catalog import Catalog, ListingEnd
    from cachefeed._daemon.catalog_file import load_restart, restart_header, save_restart
    from cachefeed._daemon.columns import pass_order, return_freed_memory
    from cachefeed._daemon.plan import SamplingPlan

    return_freed_memory()  # as the daemon's supervisor does
    url = f"synthetic://{size}x{key_bytes}" if key_bytes else f"synthetic://{size}"
    base = _rss_mb()
    _reset_peak()
    catalog = Catalog(RemoteConfig(url=url, refresh_interval_s=DEFAULT_REFRESH_S), rank=rank, count=count)
    plan = SamplingPlan(rank=rank, count=count)
    started = time.perf_counter()
    catalog.start()
    first_fetch = None
    end: ListingEnd | None = None
    while end is None:
        items = catalog.take(64)
        if not items:
            time.sleep(0.001)
        for item in items:
            if isinstance(item, ListingEnd):
                plan.end_listing()
                end = item
            else:
                plan.update_page(item)
        if first_fetch is None and plan.next(1):
            first_fetch = time.perf_counter() - started
    listing_s = time.perf_counter() - started
    plan.next(1)
    # What the daemon does next, counted in the peak: write the restart catalog (from the live table), and lay
    # out a pass over every object (what each new pass does, ``SamplingPlan._start_next_pass``).
    path = work / "catalog.cfcat"
    header = restart_header(url, "**", rank, count)
    started_save = time.perf_counter()
    save_restart(path, plan.table, plan.listed(), header, mode=0o600, max_bytes=1 << 40)
    save_s = time.perf_counter() - started_save
    laid_out = pass_order(plan.table.runs(), seed=1)
    del laid_out
    peak = _rss_mb("VmHWM")
    state = catalog.state()
    catalog.stop()
    list_requests = SyntheticFS.requests
    figures: dict[str, Any] = {
        "objects": size,
        "owned": plan.owned,
        "rank": rank,
        "count": count,
        "listing_s": round(listing_s, 3),
        "first_fetch_s": round(first_fetch or listing_s, 3),
        "list_requests": list_requests,
        "refresh_interval_s": state.refresh_interval_s,
        "rss_mb": round(peak - base, 1),
        "rss_per_object": round((peak - base) * 2**20 / size, 1),
        "plan_bytes_per_owned": round((plan.nbytes - plan.table.key_bytes) / max(plan.owned, 1), 1),
        "key_bytes_per_owned": round(plan.table.key_bytes / max(plan.owned, 1), 1),
    }
    figures["restart_save_s"] = round(save_s, 3)
    figures["restart_file_mb"] = round(path.stat().st_size / 2**20, 1)
    del plan
    started = time.perf_counter()
    restarted = SamplingPlan(rank=rank, count=count)
    restart_first = None
    for page in load_restart(path, header):  # as the listing thread streams it to the supervisor
        restarted.update_page(page)
        if restart_first is None and restarted.next(1):
            restart_first = time.perf_counter() - started
    restarted.end_listing(is_restored=True)
    figures["restart_first_fetch_s"] = round(restart_first or 0.0, 3)
    figures["restart_whole_s"] = round(time.perf_counter() - started, 3)
    return figures


S3_PREFIX = "set"


def _daemon_figures(server: Any, config: Path, cache_dir: Path, objects: int, log: Path) -> dict[str, Any]:
    """Start a real daemon on ``config``; time its first object GET at the server (polled every 20 ms), wait until
    its listing is complete and its restart catalog written; return its supervisor's peak RSS and the server's
    counts. The daemon is stopped (SIGTERM) before returning."""
    from benchmarks.common.s3server import fetch_stats, stats_delta
    from cachefeed._testing.daemon import start_daemon, wait_for

    before = fetch_stats(server.endpoint)
    started = time.perf_counter()
    daemon = start_daemon(config, cache_dir, log)
    first_list = first_get = None
    try:
        while first_get is None:
            if daemon.process.poll() is not None:
                raise RuntimeError(f"the daemon exited with {daemon.process.returncode}: {daemon.stderr()[-2000:]}")
            delta = stats_delta(before, fetch_stats(server.endpoint))["requests"]
            now = time.perf_counter() - started
            if first_list is None and delta.get("list"):
                first_list = now
            if delta.get("get") or delta.get("get_range"):
                first_get = now
            if time.perf_counter() - started > 600:
                raise TimeoutError("no object fetched within 600 s")
            time.sleep(0.02)
        daemon.wait_status(
            lambda doc: doc["remote"]["objects_listed"] >= objects and doc["remote"]["last_listed_at"],
            timeout_s=1800,
            what=f"a complete listing of {objects} objects",
        )
        wait_for(lambda: list(cache_dir.glob("catalog-*.cfcat")), timeout_s=300, what="the restart catalog")
        peak_mb = _process_rss_mb(daemon.pid, "VmHWM")
        listed_s = time.perf_counter() - started
    finally:
        daemon.stop()
    served = stats_delta(before, fetch_stats(server.endpoint))["requests"]
    return {
        "first_fetch_s": round(first_get, 3),
        "first_list_s": round(first_list if first_list is not None else first_get, 3),
        "listed_by_s": round(listed_s, 1),  # the status (every 200 ms) showed the listing complete
        "supervisor_peak_rss_mb": round(peak_mb, 1),
        "list_requests": served.get("list", 0),
        "objects_fetched": served.get("get", 0) + served.get("get_range", 0),
    }


def _process_rss_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure_s3(objects: int, work: Path) -> dict[str, Any]:
    """A bucket of ``objects`` tiny ``.npy`` objects (1,000 per directory) on the local S3 server (moto, counting
    what it serves), read by a real daemon (``python -m cachefeed daemon``, 1 sampler process), then the same
    daemon restarted on its cache directory. Reports, per start: seconds from the daemon's start to its first
    object GET at the server (and to its first LIST), the supervisor's peak RSS (``VmHWM``, read once the listing
    is complete and the restart catalog written), and the LIST requests the server answered. The objects are put
    into the server's store directly (``s3server.fill_bucket``: moto accepts about 100 PUT requests a second on a
    loaded 2-core host, 10⁵ would take 15 minutes); everything the daemon does goes through its HTTP API."""
    import numpy as np

    from benchmarks.common.s3server import S3Server, fill_bucket
    from cachefeed._config import toml_text
    from cachefeed._testing.local_s3 import s3_client, storage_options
    from cachefeed._testing.samples import npy_bytes

    server = S3Server.start()
    try:
        s3_client(server.endpoint).create_bucket(Bucket="catalog")
        body = npy_bytes(np.arange(16, dtype=np.uint8))
        started = time.perf_counter()
        fill_bucket(server.endpoint, "catalog", S3_PREFIX, objects, body, PER_DIR)
        upload_s = time.perf_counter() - started
        cache_dir = work / "cache"
        document = {
            "remote": {
                "url": f"s3://catalog/{S3_PREFIX}",
                "storage_options": storage_options(server.endpoint),
                "refresh_interval": "1h",
            },
            "cache": {"dir": str(cache_dir), "max_bytes": "2GiB", "min_free_bytes": 0, "fsync": False},
            "sampler": {"processes": 1, "concurrency": 8},
            "status": {"interval": "200ms"},
        }
        config = work / "daemon.toml"
        config.write_text(toml_text(document))
        first = _daemon_figures(server, config, cache_dir, objects, work / "first.log")
        restart = _daemon_figures(server, config, cache_dir, objects, work / "restart.log")
    finally:
        server.stop()
    return {"objects": objects, "fill_s": round(upload_s, 1), "first_start": first, "restart": restart}


def run_one(size: int, rank: int, count: int, key_bytes: int = 0) -> dict[str, Any]:
    """``measure_one`` in a fresh process (clean RSS)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.catalog", "--one", str(size), str(rank), str(count), str(key_bytes)],
        capture_output=True,
        text=True,
        check=True,
        timeout=3600,
    )
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(figures), flush=True)
    return figures


def per_hour(requests: int, listing_s: float) -> float:
    """LIST requests per hour of one node listing every refresh interval (``Catalog``'s rule)."""
    return requests * 3600.0 / max(DEFAULT_REFRESH_S, COST_FACTOR * listing_s)


def _measure_s3_in_temp(objects: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        figures = measure_s3(objects, Path(work))
    print(json.dumps(figures), flush=True)
    return figures


def _row(
    size: int, key_bytes: int, node_counts: list[int], one: dict[str, Any], node_of_100: dict[str, Any] | None
) -> dict[str, Any]:
    """One size: node 0 of 1 and of 100 (measured), LIST requests per hour for each node count."""
    nodes = {}
    for count in node_counts:
        listing = per_hour(one["list_requests"], one["listing_s"])
        lister = per_hour(one["list_requests"], one["listing_s"])  # the one lister of a shared catalog
        nodes[str(count)] = {
            "list_per_node_per_hour": round(listing, 1),
            "list_job_per_hour": round(listing * count, 1),
            "shared_list_per_node_per_hour": round(lister / count, 3),
            "shared_list_job_per_hour": round(lister, 1),
        }
    return {"size": size, "key_bytes": key_bytes, "one_node": one, "node_of_100": node_of_100, "nodes": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 1000])
    parser.add_argument("--key-bytes", type=int, default=0, help="pad every key to this many bytes (default: 42-43)")
    parser.add_argument(
        "--s3", type=int, default=100_000, help="objects in the local S3 server's bucket (0: no S3 run)"
    )
    parser.add_argument(
        "--long-keys", type=int, nargs="*", default=[], help="sizes also measured with --long-key-bytes keys, 1 node"
    )
    parser.add_argument("--long-key-bytes", type=int, default=80)
    parser.add_argument(
        "--jobs", type=int, default=1, help="measurements run at once (each in a process of its own; times get longer)"
    )
    parser.add_argument("--one", type=int, nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as work:
            size, rank, count, key_bytes = args.one
            print(json.dumps(measure_one(size, rank, count, Path(work), key_bytes)))
        return
    runs = [(size, args.key_bytes, 1) for size in args.sizes] + [(size, args.key_bytes, 100) for size in args.sizes]
    runs += [(size, args.long_key_bytes, 1) for size in args.long_keys]
    runs.sort(key=lambda run: -run[0])  # the longest first
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is a process of its own
        s3 = pool.submit(_measure_s3_in_temp, args.s3) if args.s3 else None
        done = dict(zip(runs, pool.map(lambda run: run_one(run[0], 0, run[2], run[1]), runs), strict=True))
        rows = [
            _row(size, args.key_bytes, args.nodes, done[size, args.key_bytes, 1], done[size, args.key_bytes, 100])
            for size in args.sizes
        ]
        rows += [
            _row(size, args.long_key_bytes, args.nodes, done[size, args.long_key_bytes, 1], None)
            for size in args.long_keys
        ]
        figures: dict[str, Any] = {"per_dir": PER_DIR, "refresh_s": DEFAULT_REFRESH_S, "rows": rows}
        if s3 is not None:
            figures["s3"] = s3.result()
    if not args.no_save:
        print(save("catalog", figures, work_dir=Path(os.getcwd())))
    print(readme_table({"figures": figures, "command": "", "provenance": None}) if args.no_save else "")


def readme_table(doc: dict[str, Any]) -> str:
    """The README's catalog table, from a committed result document."""
    figures = doc["figures"]
    lines = [
        "| objects listed | peak RSS, 1 node (per object) | plan bytes per owned object | RSS per node of 100 | "
        "first fetch | whole listing | restart to first fetch | LIST requests per hour, whole job, every node "
        "listing | the same with a shared catalog |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in figures["rows"]:
        one, share, nodes = row["one_node"], row["node_of_100"], row["nodes"]
        node_counts = sorted(nodes, key=int)
        per_node = ", ".join(
            f"{nodes[c]['list_job_per_hour']:,.0f} ({int(c):,} node{'s' if int(c) > 1 else ''})" for c in node_counts
        )
        shared = ", ".join(f"{nodes[c]['shared_list_job_per_hour']:,.0f} ({int(c):,})" for c in node_counts)
        keys = f" ({row['key_bytes']}-byte keys)" if row.get("key_bytes") else ""
        per_node_of_100 = f"{share['rss_mb']:.0f} MB" if share else "—"
        lines.append(
            f"| {row['size']:,}{keys} | {one['rss_mb']:,.0f} MB ({one['rss_per_object']:.0f} B) "
            f"| {one['plan_bytes_per_owned']:.0f} B "
            f"+ {one['key_bytes_per_owned']:.0f} B key | {per_node_of_100} "
            f"| {one['first_fetch_s']:.2f} s "
            f"| {one['listing_s']:.1f} s | {one['restart_first_fetch_s']:.2f} s | {per_node} | {shared} |"
        )
    s3 = figures.get("s3")
    if s3:
        first, restart = s3["first_start"], s3["restart"]
        lines += [
            "",
            f"A bucket of {s3['objects']:,} objects on the local S3 server (moto on 127.0.0.1), read by a real daemon: "
            f"first object fetched {first['first_fetch_s']:.1f} s after the daemon started "
            f"({first['first_fetch_s'] - first['first_list_s']:.1f} s after its first LIST), "
            f"{first['list_requests']:,} LIST requests for the whole listing, supervisor peak RSS "
            f"{first['supervisor_peak_rss_mb']:.0f} MB; restarted on its cache: first fetch "
            f"{restart['first_fetch_s']:.1f} s after the start, supervisor peak RSS "
            f"{restart['supervisor_peak_rss_mb']:.0f} MB.",
        ]
    if doc.get("provenance"):
        lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
