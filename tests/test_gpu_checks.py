"""``scripts/gpu_checks.sh`` is what a GPU machine runs: it must name every test file that holds a ``gpu`` test.

CI has no GPU, so a ``gpu`` test in a file the script does not name would never run anywhere.
"""

from __future__ import annotations

import re
import subprocess

from tests.support.child_env import REPO

SCRIPT = REPO / "scripts" / "gpu_checks.sh"
GPU_MARK = re.compile(r"^@pytest\.mark\.gpu$", re.MULTILINE)  # the decorator on a line of its own


def test_the_gpu_script_is_valid_bash_and_names_only_test_files_that_exist() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    named = re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text())
    assert named, "the script names no test file"
    assert [path for path in named if not (REPO / path).is_file()] == []


def test_every_test_file_that_holds_a_gpu_test_is_run_by_the_gpu_script() -> None:
    named = set(re.findall(r"tests/[\w/]+\.py", SCRIPT.read_text()))
    holding = {
        str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py") if GPU_MARK.search(path.read_text())
    }
    assert holding, "no test is marked gpu: the marker was renamed?"
    assert holding <= named, f"gpu tests that scripts/gpu_checks.sh does not run: {sorted(holding - named)}"
