"""``cachefeed catalog build``: publishes generations a shared catalog reader picks up; user errors are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cachefeed import _cli as cli
from cachefeed._config import RemoteConfig
from cachefeed._daemon.columns import FoldedPage
from cachefeed._daemon.shared import KEEP, SharedCatalog
from cachefeed._remote import Remote
from cachefeed._testing.daemon import BUCKET
from cachefeed._testing.local_s3 import LocalS3
from tests.support.cli import one_line, run_cli


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
    assert code == 64 and "--storage-options is not JSON" in err
    code, _, err = run(capsys, "build", "s3://bucket")
    assert code == 64 and "--out" in err
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
    assert run(capsys, "build", f"file://{data}", "--pattern", "*.png", "--allow-empty")[0] == 0
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


def test_a_listing_of_no_objects_is_not_published_and_the_last_generation_stays(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "train" / "a.npy").write_bytes(b"x")
    assert run_cli("catalog", "build", f"file://{data}").returncode == 0
    latest = (tmp_path / "data.cfcatalog" / "LATEST").read_text()
    result = run_cli("catalog", "build", f"file://{data}", "--pattern", "*.npy")  # the files are in a subfolder
    assert result.returncode == 66
    assert one_line(result.stderr) == (
        f"cachefeed catalog build: nothing published: file://{data} lists no objects matching '*.npy' (the "
        "directory exists): check the URL and --pattern; '*.npy' matches names at the top level only, '**/*.npy' "
        "at any depth (--allow-empty publishes an empty catalog, and every daemon reading it then lists nothing)"
    )
    assert (tmp_path / "data.cfcatalog" / "LATEST").read_text() == latest  # the daemons keep their listing
    assert len(list((tmp_path / "data.cfcatalog").glob("gen-*"))) == 1
    fresh = run_cli("catalog", "build", f"file://{data}", "--pattern", "*.npy", "--out", f"file://{tmp_path}/new")
    assert fresh.returncode == 66 and not (tmp_path / "new").exists()  # nothing left where nothing was published


def test_a_typo_in_the_url_says_the_root_does_not_exist_and_allow_empty_publishes_anyway(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    result = run_cli("catalog", "build", f"file://{tmp_path}/dtaa")
    assert result.returncode == 66
    line = one_line(result.stderr)
    assert line.startswith(f"cachefeed catalog build: nothing published: file://{tmp_path}/dtaa lists no objects ")
    assert f"matching '**' ({tmp_path}/dtaa does not exist): check the URL and --pattern (--allow-empty" in line
    assert not (tmp_path / "dtaa.cfcatalog").exists()
    allowed = run_cli("catalog", "build", f"file://{tmp_path}/dtaa", "--allow-empty")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.startswith("published gen-") and ": 0 objects of" in allowed.stdout


def test_on_s3_a_pattern_that_matches_nothing_leaves_latest_and_no_generation(s3: LocalS3, bucket: Any) -> None:
    bucket.put_object(Bucket=BUCKET, Key="train/sub/a.npy", Body=b"x")
    common = ["catalog", "build", f"s3://{BUCKET}/train", "--storage-options", json.dumps(s3.storage_options())]
    assert run_cli(*common).returncode == 0

    def catalog_keys() -> dict[str, bytes]:
        listed = bucket.list_objects_v2(Bucket=BUCKET, Prefix="train.cfcatalog/").get("Contents", [])
        return {item["Key"]: bucket.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read() for item in listed}

    before = catalog_keys()
    result = run_cli(*common, "--pattern", "*.npy")
    assert result.returncode == 66
    line = one_line(result.stderr)
    assert f"nothing published: s3://{BUCKET}/train lists no objects matching '*.npy': check the URL" in line
    assert catalog_keys() == before  # LATEST names the same generation, and no new one is left behind


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--storage-options", "notjson"], "--storage-options is not JSON: Expecting value"),
        (["--storage-options", "[1]"], '--storage-options: expected a JSON object such as {"anon": true}'),
    ],
)
def test_bad_option_values_are_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli("catalog", "build", f"file://{tmp_path}", *args)
    assert result.returncode == 64
    assert one_line(result.stderr).startswith(f"cachefeed catalog: {message}")


def test_a_url_cachefeed_cannot_use_is_a_usage_error() -> None:
    for url, message in [
        ("s3://bucket", "s3://bucket: the data is a whole bucket: name where the catalog goes with --out"),
        ("foo://x/y", "'foo://x/y': Protocol not known: foo"),
    ]:
        result = run_cli("catalog", "build", url)
        assert result.returncode == 64 and message in one_line(result.stderr)


def test_a_bad_url_on_the_command_line_is_a_usage_error_even_with_a_config(tmp_path: Path) -> None:
    """The URL the user just typed is at fault (64), not the config file; the file's own URL is the file's (78)."""
    config = tmp_path / "daemon.toml"
    config.write_text(f'[remote]\nurl = "s3://bucket"\n[cache]\ndir = "{tmp_path / "cache"}"\nmax_bytes = "4GiB"\n')
    typed = run_cli("catalog", "build", "foo://x/y", "--config", str(config))
    assert one_line(typed.stderr) == "cachefeed catalog: 'foo://x/y': Protocol not known: foo"
    assert typed.returncode == 64
    config.write_text(config.read_text().replace("s3://bucket", "foo://x/y"))
    from_file = run_cli("catalog", "build", "--config", str(config))
    assert from_file.returncode == 78 and "remote.url = 'foo://x/y': Protocol not known: foo" in from_file.stderr


def test_a_plain_local_path_is_built_next_to_its_data(tmp_path: Path) -> None:
    """``catalog build /data/train`` (no file://) was refused as "a whole bucket"."""
    data = tmp_path / "train"
    data.mkdir()
    (data / "000.npy").write_bytes(b"x" * 64)
    result = run_cli("catalog", "build", str(data))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "train.cfcatalog" / "LATEST").is_file(), sorted(p.name for p in tmp_path.iterdir())
    root = run_cli("catalog", "build", "file:///")
    assert root.returncode == 64 and "the data is a filesystem's root" in one_line(root.stderr)
