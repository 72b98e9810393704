"""A reader process for race tests: pin a snapshot, read and verify every sample, release; repeat.

python -m tests.support.reader_proc ROOT NAME MIN_READS  -> prints "reads=<n> wrong=<n> errors=<n>"
"""

from __future__ import annotations

import sys
import time
import traceback

from cachefeed._cache.records import SegmentReader
from cachefeed._cache.snapshots import Snapshot
from cachefeed._testing.samples import check_sample


def main() -> None:
    root, name, min_reads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    reads = wrong = errors = 0
    round_ = 0
    deadline = time.monotonic() + 120
    while reads < min_reads and time.monotonic() < deadline:
        try:
            with Snapshot.create(root, f"{name}-{round_}") as snapshot:
                for path in snapshot.paths:
                    with SegmentReader(path) as reader:
                        for i in range(reader.count):
                            sample = reader.read(i)
                            try:
                                check_sample(sample)
                            except AssertionError:
                                wrong += 1
                            reads += 1
        except Exception:
            traceback.print_exc()
            errors += 1
        round_ += 1
    print(f"reads={reads} wrong={wrong} errors={errors}", flush=True)


if __name__ == "__main__":
    main()
