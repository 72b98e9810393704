"""A stand-alone cache writer process for crash, race and budget tests.

python -m tests.support.writer_proc ROOT MAX_BYTES SEGMENT_BYTES SAMPLE_BYTES [START_KEY]

Writes self-verifying samples forever (keys "s<n>"), publishing and evicting through a real CacheStore, and prints
"ready" once recovery is done. It is meant to be SIGKILLed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.samples import make_sample
from tests.support.cache_helpers import cache_config


def main() -> None:
    root, max_bytes, segment_bytes, sample_bytes = sys.argv[1:5]
    start = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    config = cache_config(
        Path(root), max_bytes=int(max_bytes), segment_bytes=int(segment_bytes), turnover_bytes=int(segment_bytes)
    )
    store = CacheStore(config)
    print("ready", flush=True)
    writer = CacheWriter(store, segment_bytes=config.segment_bytes, fsync=False, poll_s=0.005)
    n = start
    while True:
        writer.add(make_sample(f"s{n}", int(sample_bytes)))
        n += 1
        if n % 64 == 0:
            store.enforce()


if __name__ == "__main__":
    main()
