"""A single background thread that runs submitted calls in order, each outcome carried by a ``Future``.

Why not ``concurrent.futures.ThreadPoolExecutor``: the build thread starts DataLoader workers, and with the
``fork`` start method a worker is a fork of *that* thread. ``concurrent.futures`` registers a
``threading._register_atexit`` hook that joins every executor thread at interpreter shutdown; in the forked worker
the forking thread is an executor thread, so the hook tries to join the current thread, raises, and the worker
exits with status 1 (silently: the failure happens after its stderr is flushed), which the DataLoader reports as
"worker exited unexpectedly" whenever the parent notices in time. A plain daemon thread has no such hook.

Exceptions are carried as data: ``Future.result()`` re-raises the original exception, traceback included, on the
thread that asks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["SerialWorker"]

T = TypeVar("T")

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class SerialWorker:
    """Runs calls one at a time, in submission order, on one daemon thread (started on the first ``submit``).

    After ``shutdown`` no new call is accepted (``RuntimeError``); calls already queued still run.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._is_shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._is_shut:
                raise RuntimeError(f"{self._name} is shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # carried to whoever asks for the result
                future.set_exception(exc)
            else:
                future.set_result(result)

    def shutdown(self, *, wait: bool = True) -> None:
        """Refuse new calls, let queued ones finish; with ``wait``, join the thread."""
        with self._lock:
            if self._is_shut:
                thread = None
            else:
                self._is_shut = True
                thread = self._thread
                self._queue.put(None)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()
