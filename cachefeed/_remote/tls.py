"""One TLS context per set of verify settings and process tree, for every S3 client of the daemon.

NOTE [ One TLS context ]
    aiobotocore builds a fresh ``ssl.SSLContext`` for each client's first request and loads the CA bundle into
    it (``load_verify_locations``), for an http endpoint too, because the context is made before anyone knows it
    will go unused: ``python -m benchmarks.first_request`` prints what a forked sampler's first GET costs with and
    without this module (``benchmarks/results/first_request.json``). A daemon makes one client to list and one per
    sampler, all at its cold start, when the cores are busiest, and a restarted sampler pays it again.

    ``SharedTLSSession`` is aiobotocore's aiohttp session with that one step cached: the first client of a
    process builds the context exactly as aiobotocore does, and every later client with the same ``verify`` and
    client certificate reuses it (contexts are made to be shared by connections; aiohttp never changes one it is
    given). ``Remote.warm_session`` builds it in the supervisor before the samplers are forked, so they inherit it
    instead of loading the bundle three times. Behind a proxy nothing is cached (aiobotocore builds the endpoint's
    and the proxy's contexts together, per proxy URL): every client builds its own, as before.

    Forks: the daemon forks a sampler only while the supervisor runs one thread (``_daemon/spawn.py``); a sampler
    started later, while the listing thread runs, is a fresh interpreter and builds its own context. So no
    context is inherited while another thread of the parent could be inside OpenSSL with it. For any other fork
    (a user's, a test's), a child whose parent had a client connected does not use the contexts it inherited:
    they are set aside, never freed (freeing one takes the lock that might be the one inherited held), and the
    child builds its own. The child's lock is always a fresh one.

    The trade: a CA bundle changed on disk reaches the supervisor and the samplers forked at its start when the
    daemon restarts; a sampler started later reads it then.

    The class is used only where the installed aiobotocore builds its contexts in ``_build_ssl_contexts`` (3.9 and
    later; ``constraints.txt`` pins 3.10); with any other, ``session_class()`` is None and aiobotocore's own
    session is used, as before.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from typing import Any

from aiobotocore.httpsession import AIOHTTPSession

__all__ = ["SharedTLSSession", "prepare_tls", "session_class"]

_lock = threading.Lock()  # aiobotocore builds contexts on a worker thread (``asyncio.to_thread``)
_contexts: dict[tuple[Any, ...], ssl.SSLContext] = {}
_in_use = False  # a client of this process was given a cached context (it may be mid-handshake in some thread)
_set_aside: list[ssl.SSLContext] = []  # a forked child's inherited contexts it must not use nor free (NOTE: "Forks")


def _after_fork_in_child() -> None:
    global _lock, _in_use
    _lock = threading.Lock()
    if _in_use:  # NOTE: "Forks"
        _set_aside.extend(_contexts.values())
        _contexts.clear()
        _in_use = False


os.register_at_fork(after_in_child=_after_fork_in_child)


class SharedTLSSession(AIOHTTPSession):  # type: ignore[misc]  # aiobotocore ships no annotations
    """aiobotocore's ``AIOHTTPSession`` whose endpoint TLS context is built once per verify settings (NOTE)."""

    def _build_ssl_contexts(self, proxy_url: str | None) -> tuple[ssl.SSLContext, ssl.SSLContext | None]:
        if proxy_url:
            built: tuple[ssl.SSLContext, ssl.SSLContext | None] = super()._build_ssl_contexts(proxy_url)
            return built
        global _in_use
        context = self._cached_context()
        _in_use = True
        return context, None

    def _cached_context(self) -> ssl.SSLContext:
        key = (self._verify, self._cert_file, self._key_file)
        with _lock:
            context = _contexts.get(key)
        if context is None:  # built outside the lock (tens of ms): other keys, and other loops, do not wait on it
            built, _ = super()._build_ssl_contexts(None)
            with _lock:
                context = _contexts.setdefault(key, built)
        return context


def session_class() -> type[SharedTLSSession] | None:
    """The class to give ``AioConfig(http_session_cls=...)``, or None where this aiobotocore builds its TLS
    contexts some other way (then its own session is used)."""
    if not callable(getattr(AIOHTTPSession, "_build_ssl_contexts", None)):
        return None
    return SharedTLSSession


async def prepare_tls(client: Any) -> None:
    """Build the TLS context of an aiobotocore ``client``'s first request now, off the event loop as aiobotocore
    does, without connecting. Does nothing for a client on any other HTTP session (``session_class``)."""
    http = getattr(getattr(client, "_endpoint", None), "http_session", None)  # botocore's endpoint: no public name
    if isinstance(http, SharedTLSSession):
        await asyncio.to_thread(http._cached_context)  # built, not in use: forks keep it (NOTE: "Forks")
