"""The environment of a Python process a test starts: this checkout first on its import path, the rest kept
(``cachefeed/_testing/env.py`` says why)."""

from __future__ import annotations

from pathlib import Path

from cachefeed._testing.env import checkout_env

REPO = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with the checkout first on ``PYTHONPATH`` (what was there kept after it), then ``extra``."""
    return checkout_env(REPO, **extra)
