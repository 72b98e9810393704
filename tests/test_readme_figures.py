"""The README's benchmark figures are the committed results, rendered (``python -m benchmarks.readme``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.common.results import RESULTS_DIR
from benchmarks.readme import README, SOURCES, blocks, render


def test_every_figure_block_of_the_readme_equals_its_committed_result() -> None:
    text = README.read_text()
    _rendered, changed = render(text)
    assert changed == [], f"run `python -m benchmarks.readme`: blocks {changed} differ from benchmarks/results/"


def test_every_renderer_has_a_committed_result_and_a_block_in_the_readme() -> None:
    present = blocks(README.read_text())
    for name, (result, _module) in SOURCES.items():
        assert (RESULTS_DIR / f"{result}.json").is_file(), f"no committed result for {name}"
        assert name in present, f"the README quotes no block for {name}"


def test_a_hand_edited_figure_is_caught(tmp_path: Path) -> None:
    text = README.read_text()
    name = blocks(text)[0]
    start = text.index(f"<!-- figures:{name} -->") + len(f"<!-- figures:{name} -->")
    digit = next(i for i in range(start, len(text)) if text[i].isdigit())
    edited = text[:digit] + ("1" if text[digit] != "1" else "2") + text[digit + 1 :]
    _rendered, changed = render(edited)
    assert changed == [name]


def test_a_block_without_a_renderer_is_refused() -> None:
    with pytest.raises(KeyError, match="no renderer"):
        render("<!-- figures:nosuch -->\nx\n<!-- /figures:nosuch -->\n")
