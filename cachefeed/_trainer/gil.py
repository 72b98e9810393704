"""Prompt GIL hand-offs while a background build runs beside a training thread that never lets go of the GIL.

An eager training loop keeps its thread busy in Python (kernel launches, optimizer steps). A thread of ours that
wants the GIL then gets it only when that thread is forced to drop it, every ``sys.getswitchinterval()`` (5 ms by
default), and it drops the GIL again at each system call: building an epoch pins a snapshot (a link, an open and a
read per segment), so beside a busy loop a build outlasted its lead and the epoch after it waited for its first
batch (``benchmarks.echo`` committed at b178e98: handovers of up to 15.5 ms; since, under 5 ms).

``prompt_handoffs()`` lowers the switch interval to ``HANDOFF_INTERVAL_S`` (0.5 ms) while at least one build runs,
then restores the caller's value. The build's work is the same (the training thread pays for it either way); it is
done within the lead instead of at the boundary. The setting is process-wide: a value the program set itself in
the meantime is left as it is, and nested or concurrent uses (several factories in one process) restore it once,
after the last.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HANDOFF_INTERVAL_S", "prompt_handoffs"]

HANDOFF_INTERVAL_S = 0.0005

_lock = threading.Lock()
_users = 0
_saved = 0.0  # the interval before the first user lowered it
_ours = 0.0  # the interval we set: restored only if it is still this one


@contextmanager
def prompt_handoffs() -> Iterator[None]:
    """While inside, a thread waiting for the GIL gets it within ``HANDOFF_INTERVAL_S`` (or the program's own
    lower interval)."""
    global _users, _saved, _ours
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            if _saved > HANDOFF_INTERVAL_S:
                sys.setswitchinterval(HANDOFF_INTERVAL_S)
            _ours = sys.getswitchinterval()  # as the interpreter stores it (whole microseconds)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _ours != _saved and sys.getswitchinterval() == _ours:
                # The interpreter truncates to whole microseconds: a hair above gives back exactly the old value.
                sys.setswitchinterval(_saved + 1e-9)
