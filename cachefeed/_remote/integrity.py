"""The version pin and the body checks: a fetch returns the listed version of an object, whole, or raises.

- A listing entry's version (``version_of``) is its ETag where the backend has one, else ``"<mtime>-<size>"``.
- On S3 the GET carries ``IfMatch=<listed ETag>`` (the store answers 412 if the object changed); the returned
  ETag and ``Content-Length`` must equal the listed ones (``check_s3_response``), else ``RemoteChangedError``.
- The body must be as long as the listed size; a short body is ``RemoteTransientError``, retried (``client.py``).
- Where the object was uploaded with a checksum, botocore verifies the body against it (a mismatch is
  ``FlexibleChecksumError``: transient). Otherwise, with ``remote.verify_md5``, a body whose ETag is its MD5
  (``etag_is_md5``: a single-part upload without SSE-C or SSE-KMS) is hashed and compared
  (``check_md5``; a mismatch is ``RemoteTransientError``: corrupted in transit, retried).
- On local files the version is ``"<mtime_ns>-<size>"``, checked on the open file before and after the read
  (``check_local``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any

from cachefeed._errors import RemoteChangedError, RemoteTransientError
from cachefeed._remote.objects import RemoteObject

__all__ = ["check_local", "check_md5", "check_s3_response", "etag_is_md5", "version_of"]

_MD5_ETAG = re.compile(r"[0-9a-fA-F]{32}")
_CHECKSUM_FIELDS = ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME", "ChecksumSHA1", "ChecksumSHA256")
_MD5_INLINE_BYTES = 1 << 20  # hash smaller bodies on the event loop; larger ones in a thread (hashlib drops the GIL)


def version_of(info: Mapping[str, Any]) -> str | None:
    """A version string from a listing entry: its ETag where the backend has one, else mtime and size."""
    for name in ("ETag", "etag", "md5Hash", "generation"):
        if info.get(name):
            return str(info[name])
    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        stamp = info.get(name)
        if isinstance(stamp, int | float):
            return f"{int(stamp * 1e9)}-{info.get('size')}"
        if stamp is not None:
            return f"{stamp}-{info.get('size')}"
    return None


def check_s3_response(obj: RemoteObject, response: Mapping[str, Any]) -> None:
    """Raise ``RemoteChangedError`` unless a GetObject response's ETag and length are the listed ones."""
    etag = response.get("ETag")
    length = response.get("ContentLength")
    if obj.etag and etag and _strip_quotes(etag) != _strip_quotes(obj.etag):
        raise RemoteChangedError(f"object changed since it was listed for {obj.path}: ETag differs")
    if length is not None and obj.size >= 0 and int(length) != obj.size:
        raise RemoteChangedError(
            f"object changed since it was listed for {obj.path}: {length} bytes, listed {obj.size}"
        )


def etag_is_md5(response: Mapping[str, Any]) -> bool:
    """Whether a GetObject response's ETag is the MD5 of its body and nothing stronger was verified already."""
    if any(response.get(name) for name in _CHECKSUM_FIELDS):
        return False  # botocore validated a flexible checksum
    if response.get("SSECustomerAlgorithm") or response.get("ServerSideEncryption") in ("aws:kms", "aws:kms:dsse"):
        return False  # the ETag of an SSE-C or SSE-KMS object is not its MD5
    return bool(_MD5_ETAG.fullmatch(_strip_quotes(str(response.get("ETag", "")))))


async def check_md5(obj: RemoteObject, response: Mapping[str, Any], body: bytes) -> None:
    """Raise ``RemoteTransientError`` where the ETag is the body's MD5 (``etag_is_md5``) and the body differs."""
    etag = response.get("ETag")
    if not etag or not etag_is_md5(response):
        return
    if await _md5_hex(body) != _strip_quotes(etag).lower():
        raise RemoteTransientError(f"body of {obj.path} does not match its ETag (MD5): corrupted in transit")


def check_local(obj: RemoteObject, stat: os.stat_result) -> None:
    """Raise ``RemoteChangedError`` unless a local file's ``stat`` is the listed version."""
    version = f"{int(stat.st_mtime * 1e9)}-{stat.st_size}"
    if obj.etag is not None and version != obj.etag:
        raise RemoteChangedError(f"object changed since it was listed for {obj.path}: version differs")


async def _md5_hex(body: bytes) -> str:
    if len(body) <= _MD5_INLINE_BYTES:
        return hashlib.md5(body, usedforsecurity=False).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.md5(body, usedforsecurity=False).hexdigest())


def _strip_quotes(etag: str) -> str:
    return etag.strip().removeprefix("W/").strip('"')
