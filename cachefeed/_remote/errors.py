"""Backend errors translated to ``RemoteError`` kinds: the one table at the boundary.

``translate_error`` maps what fsspec, s3fs, botocore and aiohttp raise, from status codes, S3 error codes and
exception types (never message text):

- 404, 410, ``NoSuchKey``, a missing file -> ``RemoteNotFoundError`` (not retried);
- 401/403, ``AccessDenied``, partial credentials -> ``RemoteForbiddenError`` (not retried: the object is dropped
  until SIGHUP or until it changes);
- ``ExpiredToken``, no credentials found (an instance-metadata or token-file hiccup) -> ``RemoteTransientError``: the
  object is not at fault, and dropping every object in flight for a refresh's moment lost them for good;
- 412, ``PreconditionFailed``, s3fs's ``FileExpired`` -> ``RemoteChangedError`` (not retried: the listing is stale);
- 5xx, throttling, resets, timeouts, truncated or corrupted bodies -> ``RemoteTransientError`` (retried);
- anything else -> ``RemoteError``.

Messages are built from those structured fields and the object path only. The caller (``Remote``) then scrubs
them of every credential found in ``storage_options`` and raises them ``from None``: the backend exception is not
chained, so tracebacks cannot leak what its text held.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Iterable, Mapping

from cachefeed._errors import (
    RemoteChangedError,
    RemoteError,
    RemoteForbiddenError,
    RemoteNotFoundError,
    RemoteTransientError,
)

__all__ = ["translate_error"]

# The one translation table. Checked in this order: an S3 error code, then the HTTP status, then exception types.
_CODE_TABLE: dict[str, type[RemoteError]] = {
    "NoSuchKey": RemoteNotFoundError,
    "NoSuchBucket": RemoteNotFoundError,
    "NoSuchVersion": RemoteNotFoundError,
    "NotFound": RemoteNotFoundError,
    "AccessDenied": RemoteForbiddenError,
    "AccountProblem": RemoteForbiddenError,
    "AllAccessDisabled": RemoteForbiddenError,
    "ExpiredToken": RemoteTransientError,  # temporary credentials about to be refreshed: no reason to drop the object
    "InvalidAccessKeyId": RemoteForbiddenError,
    "InvalidObjectState": RemoteForbiddenError,
    "SignatureDoesNotMatch": RemoteForbiddenError,
    "PreconditionFailed": RemoteChangedError,
    "InternalError": RemoteTransientError,
    "OperationAborted": RemoteTransientError,
    "RequestLimitExceeded": RemoteTransientError,
    "RequestTimeout": RemoteTransientError,
    "ServiceUnavailable": RemoteTransientError,
    "SlowDown": RemoteTransientError,
    "Throttling": RemoteTransientError,
    "ThrottlingException": RemoteTransientError,
    "TooManyRequests": RemoteTransientError,
}
_STATUS_TABLE: dict[int, type[RemoteError]] = {
    401: RemoteForbiddenError,
    403: RemoteForbiddenError,
    404: RemoteNotFoundError,
    408: RemoteTransientError,
    410: RemoteNotFoundError,
    412: RemoteChangedError,
    429: RemoteTransientError,
}


@functools.cache
def _type_table() -> tuple[tuple[type[BaseException], type[RemoteError]], ...]:
    """Exception types -> errors, most specific first. Built lazily: botocore and aiohttp are heavy imports."""
    table: list[tuple[type[BaseException], type[RemoteError]]] = []
    try:
        from s3fs.utils import FileExpired  # raised by s3fs files whose ETag changed while open
    except ImportError:  # pragma: no cover - no s3fs installed
        pass
    else:
        table.append((FileExpired, RemoteChangedError))
    table += [
        (FileNotFoundError, RemoteNotFoundError),
        (IsADirectoryError, RemoteNotFoundError),
        (NotADirectoryError, RemoteNotFoundError),
        (PermissionError, RemoteForbiddenError),
    ]
    try:
        from botocore import exceptions as boto
        from botocore.parsers import ResponseParserError
    except ImportError:  # pragma: no cover - no botocore installed
        pass
    else:
        table += [
            (boto.NoCredentialsError, RemoteTransientError),  # an instance-metadata hiccup, not the object's fault
            (boto.PartialCredentialsError, RemoteForbiddenError),
            (boto.HTTPClientError, RemoteTransientError),  # read timeouts, closed connections, streaming errors
            (boto.ConnectionError, RemoteTransientError),  # connect timeouts, endpoint unreachable
            (boto.IncompleteReadError, RemoteTransientError),
            (boto.FlexibleChecksumError, RemoteTransientError),  # body corrupted in transit
            (boto.CredentialRetrievalError, RemoteTransientError),  # the credential endpoint hiccupped
            (ResponseParserError, RemoteTransientError),  # throttling replies with invalid XML (s3fs #484)
        ]
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - no aiohttp installed
        pass
    else:
        table.append((aiohttp.ClientError, RemoteTransientError))  # ClientPayloadError: truncated body
    table += [
        (TimeoutError, RemoteTransientError),
        (ConnectionError, RemoteTransientError),
        (EOFError, RemoteTransientError),
        (OSError, RemoteTransientError),
    ]
    return tuple(table)


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def translate_error(exc: BaseException, path: str) -> RemoteError:
    """Map a backend exception to a ``RemoteError`` whose message holds only the path and structured fields.

    The caller scrubs credentials and raises the result ``from None``.
    """
    if isinstance(exc, RemoteError):
        return exc
    for link in _chain(exc):
        response = getattr(link, "response", None)
        if isinstance(response, Mapping) and "Error" in response:
            code = str(response.get("Error", {}).get("Code", ""))
            status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            kind = _CODE_TABLE.get(code) or _STATUS_TABLE.get(status)
            if kind is None:
                kind = RemoteTransientError if status >= 500 else RemoteError
            return kind(f"{_describe(kind)} for {path}: HTTP {status or '?'} {code or type(link).__name__}")
    for link in _chain(exc):
        for exc_type, kind in _type_table():
            if isinstance(link, exc_type):
                reason = getattr(link, "strerror", None) if isinstance(link, OSError) else None
                detail = type(link).__name__ + (f" ({reason})" if reason else "") + _untrusted(exc) + _hint(link)
                return kind(f"{_describe(kind)} for {path}: {detail}")
    return RemoteError(f"unexpected {type(exc).__module__}.{type(exc).__name__} for {path}")


# What to do about an error whose name alone does not say (by exception class name: botocore loads lazily).
_HINTS = {
    "NoCredentialsError": (
        ": no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, "
        "~/.aws/credentials, an instance role) where the daemon runs, or remote.storage_options.anon = true for a "
        "public bucket"
    ),
}


def _hint(link: BaseException) -> str:
    return _HINTS.get(type(link).__name__, "")


def _untrusted(exc: BaseException) -> str:
    """What to say where the server's TLS certificate was not trusted (OpenSSL's reason; no secret in it)."""
    for link in _chain(exc):
        message = getattr(link, "verify_message", None)
        if isinstance(link, ssl.SSLCertVerificationError) and message:
            if getattr(link, "verify_code", None) in _UNKNOWN_ISSUER:
                return (
                    f": the endpoint's TLS certificate is not trusted ({message}); name the CA bundle that signed "
                    "it in remote.storage_options.client_kwargs.verify, or in AWS_CA_BUNDLE"
                )
            return f": the endpoint's TLS certificate was refused ({message})"
    return ""


# OpenSSL's verify codes for a certificate signed by a CA the bundle does not hold (X509_V_ERR_UNABLE_TO_GET_ISSUER_
# CERT, _DEPTH_ZERO_SELF_SIGNED_CERT, _SELF_SIGNED_CERT_IN_CHAIN, _UNABLE_TO_GET_ISSUER_CERT_LOCALLY,
# _UNABLE_TO_VERIFY_LEAF_SIGNATURE): naming the CA bundle is the fix; for others (expired, wrong host) it is not.
_UNKNOWN_ISSUER = frozenset({2, 18, 19, 20, 21})


def _describe(kind: type[RemoteError]) -> str:
    return {
        RemoteNotFoundError: "not found",
        RemoteForbiddenError: "access denied (check credentials and permissions)",
        RemoteChangedError: "object changed since it was listed",
        RemoteTransientError: "transient remote failure",
    }.get(kind, "remote failure")
