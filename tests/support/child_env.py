"""The environment of a Python process a test starts: this checkout first on its import path, the rest kept.

A child started with ``PYTHONPATH`` set to the checkout alone loses whatever the parent had there: on a GPU machine
the project's dependencies are installed with ``pip --target`` into a folder on ``PYTHONPATH`` (torch there is not
the pinned one, so the project is not installed), and a child that drops it cannot import ``watchdog``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with the checkout first on ``PYTHONPATH`` (what was there kept after it), then ``extra``."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}
