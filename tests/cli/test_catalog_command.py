"""``cachefeed catalog build``: publishes generations a shared catalog reader picks up; user errors are one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachefeed import _cli as cli
from cachefeed._config import RemoteConfig
from cachefeed._daemon.columns import FoldedPage
from cachefeed._daemon.shared import KEEP, SharedCatalog
from cachefeed._remote import Remote


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["catalog", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read(url: str, catalog: str, rank: int = 0, count: int = 1) -> tuple[int | None, list[str]]:
    reader = SharedCatalog(Remote(RemoteConfig(url=url)), catalog, rank=rank, count=count)
    paths: list[str] = []

    def on_page(page: Any) -> None:
        assert isinstance(page, FoldedPage)
        paths.extend(page.paths)

    return reader(on_page), paths


def test_build_publishes_generations_that_readers_take_and_skip_when_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(20):
        (data / f"{i:02d}.bin").write_bytes(b"x" * i)
    code, out, err = run(capsys, "build", f"file://{data}")
    assert code == 0, err
    assert "20 objects" in out
    catalog = f"file://{data}.cfcatalog"  # next to the data
    reader = SharedCatalog(Remote(RemoteConfig(url=f"file://{data}")), catalog, rank=0, count=1)
    seen: list[str] = []
    assert reader(lambda page: seen.extend(page.paths)) == 20
    assert sorted(seen) == sorted(str(p) for p in data.iterdir())
    assert reader(lambda page: seen.extend(page.paths)) is None  # LATEST names the same generation: nothing read again
    halves = [read(f"file://{data}", catalog, rank, 2)[1] for rank in range(2)]
    assert sorted(halves[0] + halves[1]) == sorted(seen) and not set(halves[0]) & set(halves[1])
    for _ in range(KEEP + 1):
        (data / "new.bin").write_bytes(b"y")
        assert run(capsys, "build", f"file://{data}")[0] == 0
    generations = sorted(p.name for p in Path(f"{data}.cfcatalog").glob("gen-*"))
    assert len(generations) == KEEP  # older ones are deleted
    assert reader(lambda page: seen.extend(page.paths)) == 21


def test_build_refuses_what_it_cannot_do_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "build")
    assert code == 64 and "name the data's URL" in err
    code, _, err = run(capsys, "build", f"file://{tmp_path}", "--storage-options", "{nope")
    assert code == 78 and "--storage-options is not JSON" in err
    code, _, err = run(capsys, "build", "s3://bucket")
    assert code == 78 and "--out" in err
    sources = tmp_path / "sources.toml"
    sources.write_text(
        f'[cache]\ndir = "{tmp_path / "c"}"\nmax_bytes = "1GiB"\n'
        '[[source]]\nname = "crawl"\nurl = "s3://b/crawl"\n[[source]]\nname = "curated"\nurl = "s3://b/cur"\n'
    )
    code, _, err = run(capsys, "build", "--config", str(sources))
    assert code == 64 and "names its data in [[source]] tables (crawl, curated), one catalog each" in err
    assert "Traceback" not in err


def test_a_reader_with_another_pattern_is_told_to_build_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachefeed._daemon.catalog_file import CatalogFileError

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jpg").write_bytes(b"x")
    assert run(capsys, "build", f"file://{data}", "--pattern", "*.png")[0] == 0
    reader = SharedCatalog(
        Remote(RemoteConfig(url=f"file://{data}", pattern="*.jpg")), f"file://{data}.cfcatalog", rank=0, count=1
    )
    with pytest.raises(CatalogFileError, match=r"build it with --pattern '\*.jpg'"):
        reader(lambda page: None)


def test_a_generation_names_its_remote_by_a_digest_and_refuses_a_reader_of_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from cachefeed._daemon.catalog_file import CatalogFileError, read_header

    data = tmp_path / "secret-token-in-the-path" / "data"
    data.mkdir(parents=True)
    (data / "a.jpg").write_bytes(b"x")
    assert run(capsys, "build", f"file://{data}", "--out", f"file://{tmp_path}/catalog")[0] == 0
    (generation,) = (tmp_path / "catalog").glob("gen-*")
    with generation.open("rb") as handle:
        header = read_header(handle.read)
    assert "secret-token" not in repr(header)  # the URL (it may hold credentials) is not stored: a digest is
    assert read(f"file://{data}", f"file://{tmp_path}/catalog")[0] == 1
    other = tmp_path / "other"
    other.mkdir()
    reader = SharedCatalog(Remote(RemoteConfig(url=f"file://{other}")), f"file://{tmp_path}/catalog", rank=0, count=1)
    with pytest.raises(CatalogFileError, match=r"lists another remote than remote\.url"):
        reader(lambda page: None)
