"""The README's promises: two commands at the top, the second is what CI runs, the docs match the code."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed._config import SCHEMA, SOURCE_SCHEMA
from cachefeed._status.schema import STATUS_SCHEMA

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def top_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_exactly_two_commands_at_the_top_and_ci_runs_the_second() -> None:
    commands = top_commands()
    assert len(commands) == 2
    assert README.index("```bash") < README.index("\n## "), "the commands come before any section"
    assert "cachefeed demo" in commands[0] and "pytest" in commands[1]
    assert all("-c constraints.txt" in command for command in commands), "torch stays pinned to the CPU build"
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_every_config_key_is_documented() -> None:
    for section, keys in SCHEMA.items():
        for key in keys:
            assert f"`{section}.{key}`" in README, f"{section}.{key} missing from the README's config reference"
    for key in SOURCE_SCHEMA:
        assert f"`source.{key}`" in README, f"[[source]] {key} missing from the README's config reference"


def test_every_key_of_the_status_document_is_documented() -> None:
    def keys(spec: object) -> Iterator[str]:
        spec = getattr(spec, "shape", spec)  # Scalar, Omittable
        if isinstance(spec, list):
            yield from keys(spec[0])
        elif isinstance(spec, dict):
            for key, inner in spec.items():
                if isinstance(key, str):
                    yield key
                yield from keys(inner)

    for key in (*keys(STATUS_SCHEMA), "heartbeat_age_s"):
        assert f"`{key}`" in README, f"status key {key!r} (_status/schema.py) is missing from the README"


@pytest.mark.slow
def test_the_readme_demo_command_works_in_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    result = subprocess.run(
        ["bash", "-c", top_commands()[0]], cwd=clone, capture_output=True, text=True, timeout=900, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "demo finished" in result.stdout


def test_the_layout_of_the_code_names_every_module() -> None:
    layout = README[README.index("## Layout of the code") :]
    layout = layout[: layout.index("\n## ")] if "\n## " in layout else layout
    package = ROOT / "cachefeed"
    for path in sorted(package.rglob("*.py")):
        if path.name != "__init__.py":
            assert path.name in layout, f"{path.relative_to(ROOT)} is missing from the README's layout of the code"
        elif path.parent != package:
            assert f"{path.parent.name}/" in layout, f"package {path.parent.name}/ is missing from the layout"
