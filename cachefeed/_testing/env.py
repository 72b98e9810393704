"""The environment of a Python process that a test or a benchmark starts from a checkout.

The checkout goes first on ``PYTHONPATH`` and what was there stays after it. A child started with ``PYTHONPATH``
set to the checkout alone loses whatever the parent had there: on a GPU machine the project's dependencies are
installed with ``pip --target`` into a folder on ``PYTHONPATH`` (torch there is not the pinned one, so the project
is not installed), and such a child cannot import ``watchdog``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["checkout_env"]


def checkout_env(root: Path, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (``os.environ`` by default) with ``root`` first on ``PYTHONPATH``, then ``extra``."""
    base = os.environ if base is None else base
    path = os.pathsep.join([str(root), *filter(None, [base.get("PYTHONPATH")])])
    return {**base, "PYTHONPATH": path, **extra}
