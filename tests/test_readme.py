"""The README's promises: two commands at the top, the second is what CI runs, the docs match the code."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from cachefeed.config import SCHEMA

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


def test_the_status_json_keys_the_issue_names_are_documented() -> None:
    for key in ("heartbeat_age_s", "pinned_bytes", "bytes_per_s", "objects_listed", "quarantined_total", "restarts"):
        assert f"`{key}`" in README


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
