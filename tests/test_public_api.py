"""The curated public API: a sorted __all__ that resolves, a CLI that does not import torch, and the import graph:
``cachefeed/_cache/`` as the ground floor, and who imports ``cachefeed._testing`` (the tests', benchmarks' and demo's
helpers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


def test_every_module_but_the_package_itself_is_private() -> None:
    """What a user may import is ``cachefeed``'s ``__all__``: every other module says it is internal by its name
    (``_codecs.py``) or its package's (``_trainer/pool.py``), so nothing else looks like a stable API."""
    package = Path(cachefeed.__file__).parent
    public = [
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if not any(part.startswith("_") for part in path.relative_to(package).parts)
    ]
    assert public == []
    assert sorted(path.name for path in package.glob("__*__.py")) == ["__init__.py", "__main__.py"]


def test_the_factory_does_not_expose_its_handover_hooks() -> None:
    from cachefeed._trainer import EpochLoaderFactory

    public = {name for name in vars(EpochLoaderFactory) if not name.startswith("_")}
    assert not {"on_progress", "on_wait", "on_exhausted"} & public


def test_the_status_command_does_not_import_torch() -> None:
    code = "import sys, cachefeed._cli; cachefeed._cli.build_parser(['status']); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_status_package_imports_no_daemon_trainer_cli_or_torch() -> None:
    """``_status/`` is the document's contract and its readers: the daemon, the trainer and the CLI import it."""
    package = Path(cachefeed.__file__).parent / "_status"
    modules = sorted(f"cachefeed._status.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__")
    above = ("cachefeed._daemon", "cachefeed._trainer", "cachefeed._cli", "torch")
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in sys.modules if m.startswith({above})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_a_sampler_imports_the_grant_contract_not_the_store() -> None:
    code = "import sys, cachefeed._daemon.sampler; print('cachefeed._cache.store' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_testing_helpers_do_not_import_pytest() -> None:
    """pytest is a test extra: the benchmarks and ``cachefeed demo`` import cachefeed._testing without it."""
    helpers = Path(cachefeed.__file__).parent / "_testing"
    modules = sorted(f"cachefeed._testing.{path.stem}" for path in helpers.glob("*.py") if path.stem != "__init__")
    code = f"import sys; import {', '.join(modules)}; print('pytest' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_only_the_demo_imports_the_testing_helpers() -> None:
    package = Path(cachefeed.__file__).parent
    importers = set()
    for path in package.rglob("*.py"):
        if package / "_testing" in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(name == "cachefeed._testing" or name.startswith("cachefeed._testing.") for name in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"_cli/demo.py"}


# The cache layer's modules may import torch only inside these functions (module, function): a tensor field of a
# sample is encoded and decoded where the segment format is, and torch is loaded only when a sample holds one.
_CACHE_LAZY_TORCH = {("descriptors.py", "_to_payload"), ("descriptors.py", "_tensor_step")}
_ABOVE_THE_CACHE = ("cachefeed._config", "cachefeed._daemon", "cachefeed._trainer", "torch")


def _imports(node: ast.AST, function: str = "") -> Iterator[tuple[str, str]]:
    """Every module an import under ``node`` names, with the function it sits in ("" at module level)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            yield from ((alias.name, function) for alias in child.names)
        elif isinstance(child, ast.ImportFrom) and child.module is not None:
            yield child.module, function
            yield from ((f"{child.module}.{alias.name}", function) for alias in child.names)
        inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
        yield from _imports(child, inner)


def test_the_cache_layer_imports_nothing_above_it() -> None:
    """``cachefeed/_cache/`` is the ground floor: it imports neither the config, the daemon, the trainer nor torch."""
    cache = Path(cachefeed.__file__).parent / "_cache"
    offences = []
    for path in sorted(cache.rglob("*.py")):
        for name, function in _imports(ast.parse(path.read_text(), str(path))):
            above = any(name == top or name.startswith(f"{top}.") for top in _ABOVE_THE_CACHE)
            is_lazy_torch = name.partition(".")[0] == "torch" and (path.name, function) in _CACHE_LAZY_TORCH
            if above and not is_lazy_torch:
                offences.append(f"{path.relative_to(cache.parent).as_posix()}: {function or '<module>'} imports {name}")
    assert offences == []
    modules = sorted(f"cachefeed._cache.{path.stem}" for path in cache.glob("*.py") if path.stem != "__init__")
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
