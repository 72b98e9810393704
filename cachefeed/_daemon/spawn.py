"""How a sampler process starts: forked from the supervisor while it runs one thread, else a fresh interpreter.

A fresh ``python -m cachefeed._daemon.sampler`` imports numpy, fsspec, s3fs and aiobotocore again before it can
fetch anything: about 0.7 s of CPU each on an idle core, and a cold daemon starts its samplers at the same moment
as its own listing and the trainer's workers, so on a small machine they queue for the cores. A sampler forked
from the supervisor has all of that loaded already (its catalog resolved the remote's filesystem class in
``preflight``): it only builds its HTTP client. The first start of every sampler happens before the supervisor
starts any thread (catalog, metrics), so it forks; a restart while those threads run (one may hold a lock the
child would inherit held) takes a fresh interpreter, as does a supervisor that already runs a second thread.

What the forked child leaves behind (``sampler.serve_forked``): the supervisor's signal handlers and wakeup
descriptor, every inherited descriptor but the protocol socket, the cache lock and stdio (stdin becomes
``/dev/null``, as for the interpreter), the notify variables (``child_env``), and the supervisor's objects: it
collects the supervisor's garbage once, while the descriptors are still the ones that garbage knew, then freezes
(``gc.freeze``) what lives, so that none of it is ever finalized in the child after the descriptors are closed; it
ends with ``os._exit``, never returning into the supervisor's stack. Both ways run the same ``sampler.serve``.

``ForkedProcess`` gives the pool what it uses of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``terminate``,
``kill``, ``send_signal``, ``returncode``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from cachefeed._logs import get_logger

__all__ = ["ForkedProcess", "fork_sampler"]

log = get_logger(__name__)

_WAIT_POLL_S = 0.005


class ForkedProcess:
    """A forked sampler, watched like a ``subprocess.Popen`` (module docstring)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"sampler pid {self.pid}", timeout or 0.0)
            time.sleep(_WAIT_POLL_S)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_sampler(fd: int, lock_fd: int, index: int) -> ForkedProcess | None:
    """Fork sampler ``index`` serving protocol socket ``fd``; None where it must start a fresh interpreter instead
    (another thread runs, or ``fork`` failed)."""
    if threading.active_count() > 1 or not hasattr(os, "fork"):
        return None
    from cachefeed._daemon import sampler  # loaded here, once: the child starts with it (and what it imports)

    parent_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        log.warning("could not fork sampler %d (%s): starting a fresh interpreter", index, exc)
        return None
    if pid == 0:  # the child: never returns into the supervisor
        code = 1
        try:
            code = sampler.serve_forked(fd, lock_fd, parent_pid, index)
        except BaseException:
            log.exception("sampler %d failed", index)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    return ForkedProcess(pid)
