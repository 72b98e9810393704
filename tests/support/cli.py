"""``python -m cachefeed ...`` as a user runs it: a child process with this checkout first on its import path."""

from __future__ import annotations

import subprocess
import sys

from tests.support.child_env import child_env

CLI = [sys.executable, "-m", "cachefeed"]


def run_cli(*argv: str, timeout_s: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``cachefeed ARGV`` to its end (killed after ``timeout_s``); ``env`` is added to the environment."""
    return subprocess.run(
        [*CLI, *argv], capture_output=True, text=True, timeout=timeout_s, env=child_env(**env), check=False
    )


def one_line(stderr: str) -> str:
    """The only line of ``stderr`` (a user mistake is one line, never a traceback)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]
