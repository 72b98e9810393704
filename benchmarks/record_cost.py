"""What one record costs: bytes in the segment for a small sample, and Python time to read a record.

    python -m benchmarks.record_cost [--dir /dev/shm] [--mib 64] [--repeats 20]

Prints five figures (``cachefeed/_cache/records.py`` and ``cachefeed/_trainer/dataset.py`` quote the first three
from one-off runs; ``records.py``'s ``RecordEncoder`` points here for the fourth, ``_codecs.py``'s tar reader for
the fifth) and writes them to ``benchmarks/results/record_cost.json`` (``--no-save`` to skip):

* ``bytes/record``: a 1 KiB float32 vector, an int label and an int id under a 30-character key (index, padding
  and trailer included), and its overhead over the 1,024-byte vector;
* ``SegmentReader.read``: microseconds per record, ``verify=False``, for records of one 128 KiB uint8 array (a
  cache of ``--mib`` MiB built by ``benchmarks.read_throughput.build_cache``, warm: one pass first);
* ``SnapshotDataset.__getitems__``: milliseconds per shuffled batch of 32 of those records, ``verify=False``;
* ``encode+append``: microseconds of ``RecordEncoder.encode`` and ``SegmentWriter.append`` per tar-like sample (a
  4 KiB uint8 array, an 8-digit key and the shard's ``__url__``, as ``decode_tar`` and the daemon's sink make them),
  what the daemon pays per sample it writes (the checksum included: xxh3 of 4 KiB is well under a microsecond);
* ``decode``: microseconds per member of the daemon's ``tar`` decoder (``get_decoder("tar")``, its checks of each
  sample included) on a webdataset shard of 4 KiB members, what the daemon pays per sample before it encodes it,
  next to Python's ``tarfile`` reading the same members' payloads in the same run (what a plain archive's fast
  reader is checked against: ``tests/test_codecs.py``).

The times are the median, and the best, of ``--repeats`` passes over every record, after one pass that is not
counted (on a shared machine the best is the steadier figure). The reads compute no checksum: what is measured is
the Python per record, which a DataLoader worker (or, without workers, the training thread) pays on every sample.
The writes go to a segment in ``--dir`` (tmpfs by default: the kernel's share is a page copy, not a disk).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common.results import save
from benchmarks.read_throughput import build_cache
from cachefeed._cache.layout import CacheLayout
from cachefeed._cache.records import RecordEncoder, SegmentReader, SegmentWriter
from cachefeed._cache.snapshots import Snapshot
from cachefeed._codecs import get_decoder
from cachefeed._trainer import SnapshotDataset

BATCH = 32


def small_record_bytes(directory: Path, count: int = 1000) -> float:
    """Bytes per record of the small sample (see the module docstring), in a segment of ``count``."""
    writer = SegmentWriter(directory / "small.seg", capacity=1 << 30)
    for i in range(count):
        sample = {"__key__": f"train/shard-{i // 1000:04d}.msgpack#{i % 1000}", "x": np.ones(256, np.float32)}
        writer.append(writer.encode({**sample, "label": i % 10, "id": i}))
    return writer.finish(fsync=False) / count


def read_us(root: Path, repeats: int) -> tuple[float, float]:
    """Median and best microseconds per ``SegmentReader.read(i, verify=False)``."""
    layout = CacheLayout(root)
    readers = [SegmentReader(layout.segments / name) for name, _info in layout.list_segments()]
    runs = []
    for _ in range(repeats + 1):  # the first pass faults the headers' pages in
        started = time.perf_counter()
        for reader in readers:
            for i in range(reader.count):
                reader.read(i, verify=False)
        runs.append((time.perf_counter() - started) / sum(r.count for r in readers))
    for reader in readers:
        reader.close()
    return statistics.median(runs[1:]) * 1e6, min(runs[1:]) * 1e6


def getitems_ms(root: Path, repeats: int) -> tuple[float, float]:
    """Median and best milliseconds per ``__getitems__`` of ``BATCH`` shuffled records, ``verify=False``."""
    with Snapshot.create(root, "record-cost") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot, verify=False)
        order = np.random.default_rng(1).permutation(len(dataset))
        batches = [order[start : start + BATCH] for start in range(0, len(order) - BATCH + 1, BATCH)]
        runs = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            for batch in batches:
                dataset.__getitems__(batch)
            runs.append((time.perf_counter() - started) / len(batches))
        dataset.close()
    return statistics.median(runs[1:]) * 1e3, min(runs[1:]) * 1e3


def write_us(directory: Path, repeats: int, count: int = 4000) -> tuple[float, float]:
    """Median and best microseconds per ``encode`` + ``append`` of a tar-like sample, ``count`` to a segment."""
    url = "s3://bench/tar/shard-00003.tar"
    payloads = np.arange(count * 4096, dtype=np.uint64).astype(np.uint8).reshape(count, 4096)
    samples = [{"x": payloads[i], "__key__": f"{i:08d}", "__url__": url} for i in range(count)]
    encoder = RecordEncoder()
    runs = []
    for _ in range(repeats + 1):  # the first pass is not counted (file pages, caches)
        writer = SegmentWriter(directory / "write.seg", capacity=1 << 30)
        encode, append = encoder.encode, writer.append
        started = time.perf_counter()
        for sample in samples:
            append(encode(sample))
        runs.append((time.perf_counter() - started) / count)
        writer.abort()
    return statistics.median(runs[1:]) * 1e6, min(runs[1:]) * 1e6


def decode_us(repeats: int, count: int = 400) -> dict[str, float]:
    """Median and best microseconds per member of the daemon's ``tar`` decoder on one shard of ``count`` 4 KiB
    members (webdataset names, ustar headers, as ``benchmarks/cachefeed_tar_adapter.py`` writes them), and the
    median of ``tarfile`` reading every member's payload from the same bytes."""
    buffer = io.BytesIO()
    payloads = np.arange(count * 4096, dtype=np.uint64).astype(np.uint8).reshape(count, 4096)
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for i in range(count):
            info = tarfile.TarInfo(f"{i:08d}.bin")
            info.size = 4096
            archive.addfile(info, io.BytesIO(payloads[i].tobytes()))
    body = buffer.getvalue()
    decode = get_decoder("tar")

    def with_tarfile() -> None:
        with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as archive:
            for member in archive:
                handle = archive.extractfile(member)
                if handle is not None:
                    handle.read()

    found: dict[str, float] = {}
    for name, run in (("decode", lambda: list(decode("shard", body))), ("tarfile", with_tarfile)):
        runs = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            run()
            runs.append((time.perf_counter() - started) / count)
        found[f"{name}_us"], found[f"{name}_best_us"] = statistics.median(runs[1:]) * 1e6, min(runs[1:]) * 1e6
    if len(list(decode("shard", body))) != count:
        raise RuntimeError("the tar decoder did not give every member")
    return {key: round(value, 2) for key, value in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="cachefeed-record-cost-") as tmp:
        root = Path(tmp)
        per_record = small_record_bytes(root)
        print(f"bytes/record (1 KiB float32 + 2 ints, 30-char key): {per_record:.0f} ({per_record / 1024 - 1:.1%})")
        build_cache(root / "cache", 128 << 10, args.mib << 20)
        figures: dict[str, float] = {"bytes_per_small_record": round(per_record, 1)}
        median, best = read_us(root / "cache", args.repeats)
        print(f"SegmentReader.read(verify=False), 128 KiB record: {median:.1f} us (best {best:.1f})")
        figures |= {"read_us": round(median, 2), "read_best_us": round(best, 2)}
        median, best = getitems_ms(root / "cache", args.repeats)
        print(f"SnapshotDataset.__getitems__ of {BATCH} x 128 KiB, verify=False: {median:.3f} ms (best {best:.3f})")
        figures |= {"getitems_ms": round(median, 4), "getitems_best_ms": round(best, 4)}
        median, best = write_us(root, args.repeats)
        print(f"RecordEncoder.encode + SegmentWriter.append, 4 KiB tar-like sample: {median:.1f} us (best {best:.1f})")
        figures |= {"encode_append_us": round(median, 2), "encode_append_best_us": round(best, 2)}
        decoded = decode_us(args.repeats)
        print(
            f"tar decoder, per 4 KiB member: {decoded['decode_us']:.1f} us (best {decoded['decode_best_us']:.1f}); "
            f"tarfile reading the same members: {decoded['tarfile_us']:.1f} us"
        )
        figures |= decoded
    if not args.no_save:
        print("wrote", save("record_cost", figures, work_dir=Path(args.dir or tempfile.gettempdir())))


if __name__ == "__main__":
    main()
