"""sd_notify without libsystemd: exact datagrams on a real unix socket the test binds (path and abstract)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed._daemon.notify import NOTIFY_VARIABLES, SystemdNotifier, child_env


class Listener:
    """A bound AF_UNIX datagram socket standing in for systemd's notify socket."""

    def __init__(self, sock: socket.socket, env_value: str) -> None:
        self.sock = sock
        self.env_value = env_value

    def receive(self) -> bytes:
        return self.sock.recv(4096)

    def assert_empty(self) -> None:
        self.sock.setblocking(False)
        try:
            with pytest.raises(BlockingIOError):
                self.sock.recv(4096)
        finally:
            self.sock.setblocking(True)


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(5.0)  # a missing datagram fails the test instead of hanging it
    if request.param == "path":
        path = tmp_path / "notify.sock"
        sock.bind(str(path))
        env_value = str(path)
    else:
        name = f"cachefeed-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        env_value = "@" + name
    yield Listener(sock, env_value)
    sock.close()


def test_messages_are_the_exact_datagrams(listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": listener.env_value}) as notifier:
        assert notifier.is_enabled
        notifier.ready()
        assert listener.receive() == b"READY=1"
        notifier.status("filling 3.2 GiB / 64.0 GiB")
        assert listener.receive() == b"STATUS=filling 3.2 GiB / 64.0 GiB"
        notifier.watchdog()
        assert listener.receive() == b"WATCHDOG=1"
        notifier.extend_timeout(30_000_000)
        assert listener.receive() == b"EXTEND_TIMEOUT_USEC=30000000"
        notifier.stopping()
        assert listener.receive() == b"STOPPING=1"
        notifier.ready(status="serving")
        assert listener.receive() == b"READY=1\nSTATUS=serving"
    listener.assert_empty()


def test_status_is_folded_onto_one_line(listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": listener.env_value}) as notifier:
        notifier.status("line one\nREADY=1\n")
        assert listener.receive() == b"STATUS=line one READY=1"


def test_forged_assignments_are_rejected(listener: Listener) -> None:
    with SystemdNotifier({"NOTIFY_SOCKET": listener.env_value}) as notifier:
        with pytest.raises(ValueError, match="without newlines"):
            notifier.notify("STATUS=x\nREADY=1")
        with pytest.raises(ValueError, match="integer > 0"):
            notifier.extend_timeout(0)
    listener.assert_empty()


def test_no_socket_means_no_op() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.is_enabled
    assert notifier.notify("READY=1") is False
    notifier.ready()
    notifier.status("x")
    notifier.watchdog()
    notifier.stopping()
    assert notifier.watchdog_interval_s() is None
    notifier.close()


def test_unsupported_socket_form_is_a_logged_no_op(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cachefeed.daemon.notify"):
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.is_enabled
    assert notifier.notify("READY=1") is False
    assert "vsock:2:1234" in caplog.text


def test_send_errors_are_logged_once_and_never_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "gone.sock"
    with caplog.at_level(logging.DEBUG, logger="cachefeed.daemon.notify"):
        notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
        for _ in range(5):
            assert notifier.notify("WATCHDOG=1") is False
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "could not notify systemd" in warnings[0].getMessage()

        # The manager comes back: sending works again, and a later failure warns again.
        receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        receiver.settimeout(5.0)
        receiver.bind(str(path))
        assert notifier.notify("WATCHDOG=1") is True
        assert receiver.recv(64) == b"WATCHDOG=1"
        receiver.close()
        path.unlink()
        assert notifier.notify("WATCHDOG=1") is False
        notifier.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000", "WATCHDOG_PID": "4242"}, 0.5),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4243"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_PID": "4242"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert SystemdNotifier(env, pid=4242).watchdog_interval_s() == expected


def test_watchdog_pid_defaults_to_our_pid() -> None:
    ours = SystemdNotifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())})
    assert ours.watchdog_interval_s() == 2.0
    theirs = SystemdNotifier({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert theirs.watchdog_interval_s() is None


def test_environment_is_read_at_construction(monkeypatch: pytest.MonkeyPatch, listener: Listener) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    before = SystemdNotifier()
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env_value)
    assert not before.is_enabled
    with SystemdNotifier() as after:
        after.ready()
    assert listener.receive() == b"READY=1"


def test_child_env_drops_the_notify_variables() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin", "HOME": "/h"}
    assert child_env(env) == {"PATH": "/bin", "HOME": "/h"}
    assert env["NOTIFY_SOCKET"] == "@x"  # the input is not modified


def test_unset_environment_hides_the_socket_from_children(monkeypatch: pytest.MonkeyPatch, listener: Listener) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env_value)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    with SystemdNotifier(unset_environment=True) as notifier:
        assert not set(NOTIFY_VARIABLES) & set(os.environ)
        assert notifier.watchdog_interval_s() == 30.0
        # A real child process: it sees no socket, so its notifier stays silent.
        code = "from cachefeed._daemon.notify import SystemdNotifier as N; n = N(); n.ready(); print(n.is_enabled)"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        assert done.stdout.strip() == "False"
        listener.assert_empty()
        notifier.ready()
        assert listener.receive() == b"READY=1"


def test_child_env_silences_a_real_subprocess(monkeypatch: pytest.MonkeyPatch, listener: Listener) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env_value)
    code = "from cachefeed._daemon.notify import SystemdNotifier as N; N().ready()"
    subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=60, check=True)
    listener.assert_empty()
    # And without child_env the same child does reach the socket: the check above can fail.
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)
    assert listener.receive() == b"READY=1"
