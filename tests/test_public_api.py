"""The curated public API: a sorted __all__ that resolves, and a CLI that does not import torch."""

from __future__ import annotations

import subprocess
import sys

import cachefeed


def test_all_is_sorted_and_every_name_resolves() -> None:
    assert cachefeed.__all__ == sorted(cachefeed.__all__)
    for name in cachefeed.__all__:
        assert getattr(cachefeed, name) is not None


def test_the_public_names_are_exactly_these() -> None:
    """Growing or shrinking the public surface is a decision: change this list with it (and the README)."""
    assert set(cachefeed.__all__) == {
        "CacheLockedError", "CacheUnusableError", "CachefeedError", "Config", "ConfigError", "CorruptRecordError",
        "DecodeImages", "DevicePrefetcher", "EpochLoader", "EpochLoaderFactory", "EpochStats", "NoSuchCacheError",
        "Snapshot", "SnapshotDataset", "SnapshotError", "load_config", "msgpack_default",
    }  # fmt: skip


def test_the_factory_does_not_expose_its_handover_hooks() -> None:
    from cachefeed.trainer import EpochLoaderFactory

    public = {name for name in vars(EpochLoaderFactory) if not name.startswith("_")}
    assert not {"on_progress", "on_wait", "on_exhausted"} & public


def test_the_status_command_does_not_import_torch() -> None:
    code = "import sys, cachefeed.cli; cachefeed.cli.build_parser(['status']); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_a_sampler_imports_the_grant_contract_not_the_store() -> None:
    code = "import sys, cachefeed.daemon.sampler; print('cachefeed.cache.store' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
