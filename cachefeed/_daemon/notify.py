"""The sd_notify protocol, spoken without libsystemd: READY, STATUS, WATCHDOG, STOPPING to the service manager.

systemd (``Type=notify``) passes the daemon a unix datagram socket in ``NOTIFY_SOCKET``: an absolute path, or
an abstract-namespace name written ``@name``. Each message is one datagram of newline-separated ``KEY=VALUE``
assignments (sd_notify(3)). ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``, the process it is meant for) tell the
daemon how often systemd expects ``WATCHDOG=1``; the daemon pings at half that interval.

Contract:

- The environment is read when a ``SystemdNotifier`` is constructed, never at import.
- Without ``NOTIFY_SOCKET`` every method is a no-op (the daemon run by hand, or under tests).
- Sending never raises: the daemon must not die because the service manager or journald hiccups. The first
  failure is logged as a warning, later ones at debug level, until a send succeeds again.
- Only the supervisor talks to systemd (``NotifyAccess=main``). Sampler subprocesses get an environment without
  the notify variables: pass ``env=child_env()`` to ``subprocess``, or construct the notifier with
  ``unset_environment=True`` before starting ``multiprocessing`` children (they inherit ``os.environ``), which is
  what libsystemd's ``unset_environment`` argument does.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping

from cachefeed._logs import get_logger

__all__ = ["NOTIFY_VARIABLES", "SystemdNotifier", "child_env"]

logger = get_logger(__name__)

NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
"""The variables through which systemd talks to its main process; children must not inherit them."""

_SEND_TIMEOUT_S = 2.0  # a stuck service manager must not stall the supervisor's loop for long


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return a copy of ``env`` (default ``os.environ``) without the notify and watchdog variables."""
    source = os.environ if env is None else env
    return {key: value for key, value in source.items() if key not in NOTIFY_VARIABLES}


def _socket_address(raw: str) -> str | None:
    """Map ``NOTIFY_SOCKET`` to an ``AF_UNIX`` address; None when the form is not one we speak."""
    if raw.startswith("@") and len(raw) > 1:
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # e.g. "vsock:..." (systemd >= 253 for VMs): not used by a daemon on the host


class SystemdNotifier:
    """Sends sd_notify messages to the service manager; a no-op when not started by one.

    Thread-safe: one lock guards the socket and the "already warned" flag, so a status thread and the main
    loop may both send. The socket is created on the first send and closed by ``close()``.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        pid: int | None = None,
        unset_environment: bool = False,
    ) -> None:
        """Read the notify variables from ``env`` (default ``os.environ``).

        Args:
            env: where to read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.
            pid: this process's id for the ``WATCHDOG_PID`` check (default ``os.getpid()``).
            unset_environment: remove the variables from ``os.environ`` after reading them, so that children
                started later (multiprocessing included) do not inherit them. Only when ``env`` is None.
        """
        source = os.environ if env is None else env
        raw_socket = source.get("NOTIFY_SOCKET", "")
        self._raw_watchdog_usec = source.get("WATCHDOG_USEC", "")
        self._raw_watchdog_pid = source.get("WATCHDOG_PID", "")
        self._pid = os.getpid() if pid is None else pid
        self._address = _socket_address(raw_socket) if raw_socket else None
        if raw_socket and self._address is None:
            logger.warning("NOTIFY_SOCKET=%r is not a path or @abstract name: not notifying systemd", raw_socket)
        if unset_environment and env is None:
            for name in NOTIFY_VARIABLES:
                os.environ.pop(name, None)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._is_failing = False

    @property
    def is_enabled(self) -> bool:
        """True when a service manager's notify socket was given."""
        return self._address is not None

    def ready(self, status: str | None = None) -> None:
        """Tell systemd that start-up finished (``READY=1``), optionally with a status line."""
        self.notify("READY=1", *([_status_line(status)] if status is not None else []))

    def status(self, text: str) -> None:
        """Set the one-line status shown by ``systemctl status`` (``STATUS=...``)."""
        self.notify(_status_line(text))

    def stopping(self) -> None:
        """Tell systemd that the daemon is draining and will exit (``STOPPING=1``)."""
        self.notify("STOPPING=1")

    def watchdog(self) -> None:
        """Ping the watchdog (``WATCHDOG=1``); send it every ``watchdog_interval_s() / 2`` seconds."""
        self.notify("WATCHDOG=1")

    def extend_timeout(self, usec: int) -> None:
        """Ask for ``usec`` more microseconds before the start or stop timeout fires (``EXTEND_TIMEOUT_USEC``).

        Used during a long recovery scan: systemd otherwise kills a daemon that is slow to become READY.
        """
        if isinstance(usec, bool) or not isinstance(usec, int) or usec <= 0:
            raise ValueError(f"extend_timeout: usec = {usec!r}: expected an integer > 0")
        self.notify(f"EXTEND_TIMEOUT_USEC={usec}")

    def watchdog_interval_s(self) -> float | None:
        """The watchdog interval systemd expects, in seconds; None when the watchdog is off or not for us.

        ``WATCHDOG_USEC`` must be a positive integer; when ``WATCHDOG_PID`` is set it must equal our pid
        (a child that inherited the variables must not ping on its parent's behalf).
        """
        raw = self._raw_watchdog_usec.strip()
        if not raw.isdigit() or int(raw) == 0:
            return None
        raw_pid = self._raw_watchdog_pid.strip()
        if raw_pid and (not raw_pid.isdigit() or int(raw_pid) != self._pid):
            return None
        return int(raw) / 1_000_000

    def notify(self, *assignments: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines. Returns True when sent, False when off or failed.

        Never raises for send errors (see the module docstring); a newline inside an assignment is rejected
        with ValueError because it would forge another assignment.
        """
        if any("\n" in item or "=" not in item for item in assignments):
            raise ValueError(f"notify: {assignments!r}: expected KEY=VALUE assignments without newlines")
        if self._address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    self._sock.settimeout(_SEND_TIMEOUT_S)
                self._sock.sendto(payload, self._address)
            except OSError as exc:
                level = logging.DEBUG if self._is_failing else logging.WARNING
                logger.log(level, "could not notify systemd (%s): %s", assignments[0], exc)
                self._is_failing = True
                return False
            if self._is_failing:
                logger.info("notifying systemd works again")
                self._is_failing = False
            return True

    def close(self) -> None:
        """Close the socket; later sends open a new one."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> SystemdNotifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _status_line(text: str) -> str:
    """``STATUS=`` with the text folded onto one line (a newline would start a new assignment)."""
    return "STATUS=" + " ".join(str(text).split())
