"""The full-count runs (``@pytest.mark.slow``) of this suite run only when asked for with ``-m slow``.

``scripts/reliability.sh`` asks for them; a plain ``pytest`` runs the bounded default subset only (the slow runs
take tens of minutes on a 2-core machine).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="full-count reliability run: use scripts/reliability.sh (pytest -m slow)")
    for item in items:
        if item.get_closest_marker("slow") is not None and _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
