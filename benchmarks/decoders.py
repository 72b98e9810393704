"""The daemon's decoders for the benchmark systems (``sampler.decode`` of ``cachefeed`` and ``cachefeed-tar``).

The daemon imports this module in its start, on the clock of every cold figure, and a forked sampler inherits
it. So it imports only what the decoders use, numpy and cachefeed's codecs, as a user's decoder module would:
the adapters (the harness, moto helpers, the results code) stay out of the daemon. They imported about 40 ms
of modules there, some compiled from source on each start where no bytecode is cached.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cachefeed._codecs import Decoded, decode_tar

__all__ = ["TAR_FIELD", "decode_sample", "decode_tar_sample"]

TAR_FIELD = "bin"  # a tar member's extension: ``samples.sample_name(i)`` is "<8 digits>.bin"


def decode_sample(key: str, body: bytes) -> list[dict[str, Any]]:
    """A reference sample file -> one sample ``{"x": uint8 array}`` (``cachefeed``: one object per sample)."""
    return [{"x": np.frombuffer(body, dtype=np.uint8)}]


def decode_tar_sample(key: str, body: bytes) -> Decoded:
    """A webdataset shard -> one sample ``{"x": uint8 array}`` per member (``cachefeed-tar``), through the daemon's
    built-in tar decoder (webdataset's grouping), which hands on the ``bin`` member as the sample's array."""
    decoded = decode_tar(key, body)
    return Decoded(
        ({"x": np.frombuffer(sample[TAR_FIELD], dtype=np.uint8), "__key__": sample["__key__"]} for sample in decoded),
        decoded.skipped,
    )
