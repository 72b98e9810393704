"""A ``file://`` remote of small .npy objects and a daemon config over it: the setup of many daemon tests.

``npy_remote`` writes the objects (object ``i`` holds the value ``i``, so every received sample says which it is);
``file_daemon_config`` writes a config whose defaults are the small, fast daemon those tests want, each section's
keys overridable.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from cachefeed._config import toml_text
from cachefeed._testing.samples import npy_bytes


def npy_remote(directory: Path, count: int, *, values: int = 16, start: int = 0, prefix: str = "") -> Path:
    """``directory`` (made if need be) with ``prefix{i:03d}.npy`` for ``i`` in ``[start, start + count)``, each
    ``values`` int32 of ``i``."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        (directory / f"{prefix}{i:03d}.npy").write_bytes(npy_bytes(np.full(values, i, np.int32)))
    return directory


def file_daemon_config(
    path: Path, remote: Path, cache: Path, sections: Mapping[str, Mapping[str, Any]] | None = None
) -> Path:
    """A daemon config at ``path`` caching ``remote`` in ``cache``: one sampler decoding npy, a 64 MiB budget of
    4 KiB segments, no fsync, status every 200 ms, no refresh; ``sections`` override or add keys per section."""
    config: dict[str, dict[str, Any]] = {
        "remote": {"url": remote.as_uri(), "refresh_interval": "1h"},
        "cache": {"dir": str(cache), "max_bytes": "64MiB", "segment_bytes": "4KiB", "fsync": False},
        "sampler": {"processes": 1, "decode": "npy"},
        "status": {"interval": "200ms"},
    }
    for section, values in (sections or {}).items():
        config.setdefault(section, {}).update(values)
    path.write_text(toml_text(config))
    return path
