"""``cachefeed status --json`` prints JSON on stdout in every case it can answer, with the documented exit status.

Where no daemon has written a status document (no cache at the path, an empty directory, a directory of other
files) or the ``--config`` file is bad, a script reading stdout still gets one JSON object: ``health`` with the
exit status and the reason, the path in ``cache.dir`` (null where a bad config hides it), the error's line in
``error``; stderr keeps that line for a person, as without ``--json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import one_line, run_cli


def missing(tmp_path: Path) -> Path:
    return tmp_path / "not-yet"


def empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def other_files(tmp_path: Path) -> Path:
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "000.npy").write_bytes(b"x")
    return tmp_path / "dataset"


def answer(*argv: str) -> tuple[int, dict[str, Any], str]:
    """Exit status, the JSON object on stdout (the whole of stdout), and the one line on stderr."""
    result = run_cli("status", *argv, timeout_s=30)
    return result.returncode, json.loads(result.stdout), one_line(result.stderr)


@pytest.mark.parametrize("where", [missing, empty, other_files])
def test_json_without_a_status_document_is_a_json_object_naming_the_path_and_exits_66(
    tmp_path: Path, where: Callable[[Path], Path]
) -> None:
    path = where(tmp_path)
    code, shown, line = answer("--cache-dir", str(path), "--json")
    assert code == 66
    assert shown["state"] is None and shown["heartbeat_age_s"] is None
    assert shown["health"] == {"status": "no_such_cache", "exit_status": 66, "reasons": [shown["error"]]}
    assert shown["cache"] == {"dir": str(path)}
    assert str(path) in shown["error"] and line == f"cachefeed status: {shown['error']}"


def test_json_with_a_bad_config_is_a_json_object_and_exits_78(tmp_path: Path) -> None:
    config = tmp_path / "cachefeed.toml"
    config.write_text("[cache\n")
    code, shown, line = answer("--config", str(config), "--json")
    assert code == 78
    assert shown["health"]["status"] == "bad_config" and shown["health"]["exit_status"] == 78
    assert shown["cache"] == {"dir": None}, "the config that names the cache dir did not parse"
    assert str(config) in shown["error"] and line == f"cachefeed status: {shown['error']}"


def test_without_json_the_same_cases_print_only_their_line(tmp_path: Path) -> None:
    result = run_cli("status", "--cache-dir", str(missing(tmp_path)), timeout_s=30)
    assert result.returncode == 66 and result.stdout == ""
    assert one_line(result.stderr).startswith(f"cachefeed status: no cache at {missing(tmp_path)}")
