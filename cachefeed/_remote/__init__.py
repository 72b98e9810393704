"""The remote transport: list the objects under an fsspec URL and fetch each one whole, through one retry layer.

- ``client.py``: ``Remote`` (list, fetch, connect, close); the contract of ``fetch`` and NOTE [ One retry layer ].
- ``errors.py``: backend exceptions translated to ``RemoteError`` kinds, through one table.
- ``limits.py``: backoff, the retry budget, the rate caps.
- ``integrity.py``: the version pin (ETag, length, local mtime) and the MD5 check.
- ``cachefeed/_patterns.py`` (beside this package: the config checks patterns too): the matcher of
  ``remote.pattern``.
- ``objects.py``: ``RemoteObject`` and ``RemoteStats``.

Credentials are scrubbed from error messages by ``cachefeed._scrub``, the scrubber the logs use too.

Internal: not a stable API (the daemon uses it; configure it through ``[remote]``/``[[source]]``).
"""

from cachefeed._remote.client import Remote
from cachefeed._remote.objects import RemoteObject, RemoteStats

__all__ = ["Remote", "RemoteObject", "RemoteStats"]
