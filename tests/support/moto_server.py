"""The tests' local S3 server: ``cachefeed.local_s3`` (one launcher for the demo, the tests and the benchmarks)."""

from __future__ import annotations

from cachefeed.local_s3 import DUMMY_ENV, free_port, s3_client, storage_options
from cachefeed.local_s3 import LocalS3 as MotoServer

__all__ = ["DUMMY_ENV", "MotoServer", "free_port", "s3_client", "storage_options"]
