"""The sampler processes as the supervisor sees them: start, watch, restart with backoff, drain, kill.

Each ``SamplerHandle`` holds one sampler's process, its end of the protocol socket, and what the supervisor must
undo if it dies: the objects assigned and not done, and the grants outstanding (see NOTE [ Supervisor-sampler
protocol ] in ``protocol.py``). The pool does not touch the plan or the store itself: ``reap`` returns the handles
that died, and the supervisor re-queues and aborts for them before calling ``schedule_restart``.

Silence (``_check_heartbeat``). A running sampler's event loop sends ``Stats`` every second, whatever its fetches
and its writer thread do: fetches are asynchronous (a local file is read on a worker thread), decoding runs on the
writer thread. So a sampler that sends nothing has stopped as a whole: SIGSTOP or a debugger, a machine that gives
it no CPU, a hang that holds the interpreter (a native decoder that never releases the GIL). Meanwhile the objects
assigned to it are fetched by nobody else, and a pass ends only once they are done (``plan.py``), so ingest stops at
the end of the pass. Silent for ``status.stuck_after``, but at least ``SILENT_MIN_S`` and at most
``SILENT_MAX_S`` (ten to thirty missed heartbeats: a loaded machine or a long GC pause delays a few, and a short
``stuck_after`` set to catch stuck trainers must not make a healthy sampler degraded), the sampler makes the daemon
degraded, named with how long and how many objects it holds. It is killed on the stuck-decode rule's time
(``Supervisor._watch_writers``), twice ``status.stuck_after``, but not before ``KILL_MIN_S`` (its objects are
re-queued, a death while writing counts for the object it decodes, NOTE [ Supervisor-sampler protocol ]): a decoder
that holds the GIL is silence too, and is given the same time as one that does not; a slow fetch never silences
the loop, so it is never killed for it. The fixed timeout this replaced did both wrong: it said nothing
for a minute while ingest waited, and it killed a decoder the stuck-decode rule lets run. A sampler still
starting (nothing heard since its spawn: a fresh interpreter's imports, its client's warm-up) holds no object, work
being sent only against its credit: its silence holds up nothing, and it is given ``_START_TIMEOUT_S``, or the
rule's time where that is longer.
"""

from __future__ import annotations

import enum
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cachefeed._daemon.notify import child_env
from cachefeed._daemon.protocol import Exiting, Init
from cachefeed._daemon.spawn import ForkedProcess, fork_sampler
from cachefeed._daemon.wire import Channel, ChannelClosed, Message, socket_pair
from cachefeed._logs import get_logger

__all__ = ["SamplerHandle", "SamplerPool", "SamplerState"]

log = get_logger(__name__)

_SEND_TIMEOUT_S = 5.0
_START_TIMEOUT_S = 60.0  # a starting sampler's first message (module docstring, "Silence")
# A running sampler sends Stats every second: silence is reported after status.stuck_after within these bounds, and
# killed after twice status.stuck_after, not before KILL_MIN_S (module docstring, "Silence")
SILENT_MIN_S, SILENT_MAX_S, KILL_MIN_S = 10.0, 30.0, 20.0
_HEALTHY_AFTER_S = 30.0  # a sampler up this long has its restart backoff reset


class SamplerState(enum.Enum):
    """Life of a sampler slot. Transitions: STARTING -> RUNNING (first message) -> RESTARTING (died) ->
    STARTING (respawned) ...; any -> STOPPED (drained or killed at shutdown)."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"


@dataclass(slots=True)
class SamplerHandle:
    """One sampler slot. ``assigned`` (and the grants it holds, ``grants.py``) are what a death must undo."""

    index: int
    state: SamplerState = SamplerState.STARTING
    process: subprocess.Popen[bytes] | ForkedProcess | None = None
    channel: Channel | None = None
    restarts: int = 0
    credits: int = 0
    assigned: dict[int, int] = field(default_factory=dict)  # oid -> its listed size, until done, failed or re-queued
    assigned_bytes: int = 0  # the sum of ``assigned``'s sizes (``assign`` and ``settle`` keep it)
    assigned_at: dict[int, float] = field(default_factory=dict)  # oid -> time.monotonic() it was assigned
    stats: dict[str, Any] = field(default_factory=dict)  # the latest Stats message's remote counters
    objects_total: int = 0
    base_objects_total: int = 0  # objects of earlier incarnations
    last_error: str = ""  # why its last life ended (or a spawn failed), for status
    exit_reason: str = ""  # why this life is ending, where known before its exit status: then its last_error
    writer_heard_at: float = 0.0  # time.time() of the last message its writer thread sent (grants, done, failed)
    hung: str = ""  # why its writer looks hung (``Supervisor._watch_writers``), for status; "" when it does not
    silent: str = ""  # why it looks stopped (nothing heard for ``status.stuck_after``), for status; "" when it does not
    holding_up: str = ""  # why ingest waits for the objects it holds (``Supervisor._watch_held``); "" when it does not
    started_at: float = 0.0
    last_heard: float = 0.0
    restart_at: float = 0.0
    backoff_s: float = 0.0
    is_drained: bool = False
    is_killed: bool = False  # killed for its silence (``_check_heartbeat``): not again until it is reaped

    def assign(self, objects: list[tuple[int, int]]) -> None:
        """``(oid, size)`` of objects sent to this sampler: assigned until done, failed or re-queued."""
        now = time.monotonic()
        for oid, listed in objects:
            size = max(listed, 0)  # -1: a manifest that gives no size
            self.assigned_bytes += size - self.assigned.get(oid, 0)
            self.assigned[oid] = size
            self.assigned_at[oid] = now

    def settle(self, oids: list[int]) -> list[int]:
        """Those of ``oids`` this sampler was assigned, no longer assigned (done, failed, or to re-queue)."""
        settled = [oid for oid in oids if oid in self.assigned]
        for oid in settled:
            self.assigned_bytes -= self.assigned.pop(oid)
            self.assigned_at.pop(oid, None)
        return settled

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    @property
    def is_alive(self) -> bool:
        return self.channel is not None


class SamplerPool:
    """Starts and watches ``count`` samplers. Driven by the supervisor's main loop only.

    Args:
        count: number of sampler processes.
        make_init: builds the ``Init`` message for sampler ``index``.
        lock_fd: the cache writer lock, inherited by every sampler.
        backoff_s / backoff_max_s: first and largest restart delay.
        stuck_after_s: ``status.stuck_after``: how long a running sampler may say nothing (module docstring).
    """

    def __init__(
        self,
        count: int,
        *,
        make_init: Callable[[int], Init],
        lock_fd: int,
        backoff_s: float,
        backoff_max_s: float,
        stuck_after_s: float,
    ) -> None:
        self.handles = [SamplerHandle(index, backoff_s=backoff_s) for index in range(count)]
        self._make_init = make_init
        self._lock_fd = lock_fd
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._stuck_after_s = stuck_after_s
        self.retired_stats: list[dict[str, Any]] = []  # remote counters of dead incarnations

    def __iter__(self) -> Iterator[SamplerHandle]:
        return iter(self.handles)

    def live(self) -> list[SamplerHandle]:
        return [handle for handle in self.handles if handle.is_alive]

    # -- start ----------------------------------------------------------------------------------------------

    def start(self, handle: SamplerHandle) -> None:
        """Spawn the process of ``handle`` and send it ``Init``. A failure to spawn schedules a restart."""
        parent, child = socket_pair()
        try:
            process: subprocess.Popen[bytes] | ForkedProcess | None = fork_sampler(
                child.fileno(), self._lock_fd, handle.index
            )
            process = process or subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "cachefeed._daemon.sampler",
                    "--fd",
                    str(child.fileno()),
                    "--parent-pid",
                    str(os.getpid()),
                    "--index",
                    str(handle.index),
                ],
                pass_fds=(child.fileno(), self._lock_fd),
                env=child_env(),
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            parent.close()
            log.error("could not start sampler %d: %s", handle.index, exc)
            handle.last_error = f"spawn failed: {exc}"
            self.schedule_restart(handle)
            return
        finally:
            child.close()
        now = time.monotonic()
        handle.process = process
        handle.channel = Channel(parent, send_timeout_s=_SEND_TIMEOUT_S)
        handle.state = SamplerState.STARTING
        handle.credits = 0
        handle.stats = {}
        handle.objects_total = 0
        handle.started_at = handle.last_heard = now
        handle.is_drained = False
        handle.exit_reason = handle.silent = ""
        handle.is_killed = False
        how = "forked" if isinstance(process, ForkedProcess) else "a fresh interpreter"
        log.info("started sampler %d (pid %d, %s)", handle.index, process.pid, how)
        self.send(handle, self._make_init(handle.index))

    def send(self, handle: SamplerHandle, message: Message) -> bool:
        """Send to a live sampler; a dead or stuck one is killed (``reap`` will report it). True if sent."""
        if handle.channel is None:
            return False
        try:
            handle.channel.send(message)
        except (ChannelClosed, TimeoutError) as exc:
            log.warning("sampler %d does not take messages (%s): killing it", handle.index, exc)
            handle.exit_reason = f"unresponsive: {exc}"
            self.kill(handle)
            return False
        return True

    # -- watch ----------------------------------------------------------------------------------------------

    def heard_from(self, handle: SamplerHandle) -> None:
        handle.last_heard = time.monotonic()
        if handle.state is SamplerState.STARTING:
            handle.state = SamplerState.RUNNING

    def reap(self, *, lost: set[int] | None = None) -> list[SamplerHandle]:
        """Handles whose process died, whose socket hit EOF (indexes in ``lost``) or that stopped answering.

        Each returned handle is closed and reaped; the caller undoes its work, then calls ``schedule_restart``.
        """
        died = []
        now = time.monotonic()
        for handle in self.handles:
            if handle.channel is None or handle.process is None:
                continue
            self._check_heartbeat(handle, now)
            is_lost = lost is not None and handle.index in lost
            if handle.process.poll() is None and not is_lost:
                continue
            self._close(handle)
            died.append(handle)
        return died

    def _check_heartbeat(self, handle: SamplerHandle, now: float) -> None:
        """Say (``handle.silent``, logged once) and kill (once) a sampler that has sent nothing for too long (module
        docstring, "Silence")."""
        silent, limit, was = now - handle.last_heard, self._stuck_after_s, handle.silent
        handle.silent = ""
        if handle.is_killed:
            return
        if handle.state is SamplerState.STARTING:
            if silent > max(_START_TIMEOUT_S, 2 * limit):  # no object held yet: silence holds up nothing
                log.warning("sampler %d sent nothing in %.0fs since it started: killing it", handle.index, silent)
                self._kill_silent(handle, f"sent nothing in {silent:.0f}s since it started")
            return
        if silent <= min(max(limit, SILENT_MIN_S), SILENT_MAX_S):
            return
        kill_after = max(2 * limit, KILL_MIN_S)
        if silent > kill_after:
            log.error("sampler %d (pid %d) has sent nothing for %.0fs: killing it", handle.index, handle.pid, silent)
            self._kill_silent(handle, f"silent for {silent:.0f}s (status.stuck_after = {limit:g}s)")
            return
        handle.silent = (
            f"sampler {handle.index} (pid {handle.pid}) has sent nothing for {silent:.0f}s (it reports every "
            f"second): stopped (SIGSTOP, a debugger) or hung; the {len(handle.assigned)} objects assigned to it are "
            "fetched by no other sampler, and ingest stops at the end of the pass until they are done. It is killed "
            f"once silent for {kill_after:g}s (twice status.stuck_after, at least {KILL_MIN_S:g}s)"
        )
        if not was:
            log.warning("%s", handle.silent)

    def _kill_silent(self, handle: SamplerHandle, reason: str) -> None:
        handle.exit_reason = handle.exit_reason or reason  # what it said before it went silent, if anything
        handle.is_killed = True
        self.kill(handle)

    def _close(self, handle: SamplerHandle) -> None:
        process, channel = handle.process, handle.channel
        handle.channel, handle.silent = None, ""
        if channel is not None:
            handle.exit_reason = _last_words(channel) or handle.exit_reason
            channel.close()
        if process is None:
            return
        try:
            code = process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        if handle.stats:
            self.retired_stats.append(handle.stats)
            handle.stats = {}
        handle.base_objects_total += handle.objects_total
        handle.objects_total = 0
        if code == 0 and not handle.is_drained:
            # A sampler exits 0 only when asked to (a drain, SIGTERM to the whole group, its supervisor gone):
            # not a death. If the supervisor still runs, it starts it again like any exited sampler.
            log.info("sampler %d (pid %d) exited (status 0)", handle.index, process.pid)
        elif not handle.is_drained:
            reason = f"killed by {_signal_name(-code)}" if code < 0 else f"exit status {code}"
            handle.last_error = handle.exit_reason or reason
            because = f" ({handle.exit_reason})" if handle.exit_reason else ""
            log.warning("sampler %d (pid %d) died: %s%s", handle.index, process.pid, reason, because)

    def schedule_restart(self, handle: SamplerHandle) -> None:
        now = time.monotonic()
        if handle.started_at and now - handle.started_at > max(_HEALTHY_AFTER_S, self._backoff_max_s):
            handle.backoff_s = self._backoff_s
        handle.state = SamplerState.RESTARTING
        handle.restart_at = now + handle.backoff_s
        log.info("restarting sampler %d in %.1fs", handle.index, handle.backoff_s)
        handle.backoff_s = min(self._backoff_max_s, handle.backoff_s * 2)

    def restart_due(self) -> None:
        """Respawn every sampler whose restart delay has passed."""
        now = time.monotonic()
        for handle in self.handles:
            if handle.state is SamplerState.RESTARTING and now >= handle.restart_at:
                handle.restarts += 1
                self.start(handle)

    def next_restart_in(self) -> float | None:
        due = [h.restart_at for h in self.handles if h.state is SamplerState.RESTARTING]
        return max(0.0, min(due) - time.monotonic()) if due else None

    # -- stop -----------------------------------------------------------------------------------------------

    def terminate(self, handle: SamplerHandle) -> None:
        """SIGTERM: the sampler exits at once, publishing nothing more (see ``sampler.py``)."""
        handle.is_drained = True  # an expected exit: not logged as a death
        if handle.process is not None and handle.process.poll() is None:
            try:
                handle.process.terminate()
            except ProcessLookupError:
                pass

    def kill(self, handle: SamplerHandle) -> None:
        if handle.process is not None and handle.process.poll() is None:
            try:
                handle.process.kill()
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        """Mark every slot stopped (no restarts) after a drain."""
        for handle in self.handles:
            handle.state = SamplerState.STOPPED


def _last_words(channel: Channel) -> str:
    """The reason of an ``Exiting`` a sampler sent just before it died, where the supervisor has not read it yet
    (it was busy with another sampler's messages when this one exited): what is left on the socket, read now."""
    reason = ""
    try:
        while (message := channel.recv(timeout_s=0)) is not None:
            if isinstance(message, Exiting):
                reason = message.reason
    except (ChannelClosed, OSError):
        pass  # EOF after the last message: the usual end
    return reason


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
