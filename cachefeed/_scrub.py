"""The one secret scrubber: which values are credentials, and how text is cleaned of them.

Everything that shows text outside the process goes through here: the log filter (``logs.redact``, over the
values registered with ``logs.add_secrets``), the remote's error messages (``Remote`` builds a ``Scrubber`` from
its ``storage_options``) and the URLs in logs, status documents and errors (``safe_url``). Given the same secret
values, a log line and a remote error message are scrubbed to the same text.

- ``secrets_from_options``: the credential values in fsspec ``storage_options`` (by key name, nested tables too);
- ``secrets_from_env``: the credential values in the environment (AWS_* keys, ``*SECRET*``/``*TOKEN*``-like names);
- ``Scrubber(values)``: replaces every value (longest first, in one pass, so a value that contains another is
  replaced whole) and then every secret *pattern* (``Authorization`` headers,
  ``X-Amz-Signature=``/``X-Amz-Credential=``/``X-Amz-Security-Token``, ``aws_secret_access_key = ...`` and
  friends, AWS access key ids ``AKIA...``/``ASIA...``) with ``***``. Values shorter than ``MIN_SECRET_CHARS`` are
  ignored: they would redact ordinary words;
- ``safe_url``: a URL with its ``user:password@`` part replaced by ``***@``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MIN_SECRET_CHARS", "REDACTED", "Scrubber", "safe_url", "secrets_from_env", "secrets_from_options"]

REDACTED = "***"
MIN_SECRET_CHARS = 4
_MIN_GUESSED_SECRET_CHARS = 8

# Environment variables whose values are credentials. Names containing one of the words below count too.
_ENV_SECRET_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
_ENV_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "CREDENTIAL", "ACCESS_KEY", "CONNECTION_STRING", "SAS_KEY")
_OPTION_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "sas", "connection_string", "username")

_QUOTE = r"""['"]?"""
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Authorization: AWS4-HMAC-SHA256 Credential=..., Signature=...   and   'Authorization': b'AWS4-...'
    (
        re.compile(
            r"((?:proxy-)?authorization" + _QUOTE + r"\s*[:=]\s*b?" + _QUOTE + r")[^'\"\r\n]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # presigned URLs and signed headers
    (
        re.compile(
            r"(x-amz-(?:signature|credential|security-token)" + _QUOTE + r"\s*[:=]\s*b?" + _QUOTE + r")[^&'\"\s,;]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # aws_secret_access_key = ..., "secret": "...", password: ..., token=...
    (
        re.compile(
            r"((?:aws_secret_access_key|aws_session_token|aws_security_token|secret_access_key|session_token"
            r"|secret_key|secret|password|passwd|token)" + _QUOTE + r"\s*[:=]\s*b?" + _QUOTE + r")[^'\"\s,;&}]+",
            re.IGNORECASE,
        ),
        r"\1" + REDACTED,
    ),
    # AWS access key ids (long-term AKIA..., temporary ASIA...)
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
)


def secrets_from_env(env: Mapping[str, str] | None = None) -> list[str]:
    """Credential values found in the environment (AWS_* keys, and any ``*SECRET*``/``*TOKEN*``-like name)."""
    env = os.environ if env is None else env
    found = []
    for name, value in env.items():
        upper = name.upper()
        if upper in _ENV_SECRET_NAMES and len(value) >= MIN_SECRET_CHARS:
            found.append(value)
        elif any(word in upper for word in _ENV_SECRET_WORDS) and len(value) >= _MIN_GUESSED_SECRET_CHARS:
            found.append(value)  # a guess by name: a longer minimum keeps flags like "true" out
    return found


def secrets_from_options(options: Mapping[str, Any]) -> list[str]:
    """Credential values in fsspec ``storage_options`` (nested tables included), by key name; longest first."""
    found: list[str] = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            found += secrets_from_options(value)
        elif isinstance(value, str) and any(word in str(name).lower() for word in _OPTION_SECRET_WORDS):
            found.append(value)
    return sorted({value for value in found if len(value) >= MIN_SECRET_CHARS}, key=len, reverse=True)


def safe_url(url: str) -> str:
    """The URL with any ``user:password@`` part replaced by ``***@``, for logs, status and error messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = REDACTED + "@" + authority.rpartition("@")[2]
    return f"{scheme}://{authority}{slash}{path}"


class Scrubber:
    """``scrubber(text)``: ``text`` with every secret value and every secret pattern replaced by ``***``.

    Immutable, so one can be shared between threads; ``with_values`` returns a scrubber that knows more values.
    """

    __slots__ = ("_regex", "values")

    def __init__(self, values: Iterable[str] = ()) -> None:
        self.values = frozenset(v for v in values if isinstance(v, str) and len(v) >= MIN_SECRET_CHARS)
        ordered = sorted(self.values, key=len, reverse=True)  # a value that contains another is replaced whole
        self._regex = re.compile("|".join(re.escape(value) for value in ordered)) if ordered else None

    def with_values(self, values: Iterable[str]) -> Scrubber:
        """A scrubber for these values and the ones this one knows (this one, where none is new)."""
        more = Scrubber(values).values
        return self if more <= self.values else Scrubber(self.values | more)

    def __call__(self, text: str) -> str:
        if self._regex is not None:
            text = self._regex.sub(REDACTED, text)
        for pattern, replacement in _PATTERNS:
            text = pattern.sub(replacement, text)
        return text
