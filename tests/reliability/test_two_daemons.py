"""Two daemons on one cache directory: the second refuses at once (exit 75) naming the first; after the first is
SIGKILLed (supervisor and samplers), the next start succeeds; two started at the same instant: exactly one wins.
"""

from __future__ import annotations

import time
from typing import Any

from cachefeed._testing.daemon import BUCKET, StartDaemon
from cachefeed._testing.samples import upload_arrays
from tests.reliability.common import group_members, report, wait_until

REFUSE_LIMIT_S = 10.0  # "at once": no wait on the lock; the time is interpreter start and imports


def test_a_second_daemon_is_refused_until_the_first_dies(bucket: Any, daemon: StartDaemon) -> None:
    upload_arrays(bucket, BUCKET, 20, 4 << 10)
    first = daemon()
    first.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="the first daemon ready")
    assert len(first.sampler_pids()) == 2
    started = time.monotonic()
    second = daemon()
    code = second.process.wait(timeout=30)
    refused_s = time.monotonic() - started
    err = second.stderr().strip()
    assert code == 75, err
    assert "Traceback" not in err, err
    assert f"pid {first.pid}" in err.splitlines()[-1], err  # the error line names the holder
    assert first.process.poll() is None and (first.status() or {}).get("pid") == first.pid

    first.kill_group()  # SIGKILL supervisor and samplers
    wait_until(lambda: not group_members(first.pid), timeout_s=10, what="the first daemon's processes gone")
    started = time.monotonic()
    third = daemon()
    third.wait_status(lambda d: d["state"] == "running", timeout_s=30, what="the next daemon ready")
    took_over_s = time.monotonic() - started
    assert third.stop() == 0

    # Two at the same instant, on the now free directory: the lock decides, exactly one runs.
    racers = [daemon(), daemon()]
    winner = wait_until(
        lambda: [r for r in racers if (r.status() or {}).get("state") == "running"], timeout_s=30, what="a winner"
    )
    losers = [r for r in racers if r not in winner]
    codes = [r.process.wait(timeout=30) for r in losers]
    assert len(winner) == 1 and codes == [75], (codes, [r.stderr() for r in racers])
    assert f"pid {winner[0].pid}" in losers[0].stderr()
    assert winner[0].stop() == 0
    report(
        "two-daemons",
        refused_exit=code,
        refused_s=refused_s,
        takeover_after_sigkill_s=took_over_s,
        race_winners=len(winner),
        violations=int(code != 75) + int(len(winner) != 1),
    )
    assert refused_s <= REFUSE_LIMIT_S
