"""Hostile sample keys: nothing is created outside the cache root, no key is ever served as another.

Three paths, because each one can hold different keys:

* **straight through the ``CacheWriter``** (any Python ``str``: NUL, lone surrogates, ``../``, absolute paths,
  1,000-byte keys, ...): >= 10,000 keys in the default run, 100,000 in the full run; read back through a
  ``Snapshot`` and ``SnapshotDataset``. Each sample's payload derives from its exact key, so a collision or a
  mix-up is a wrong sample. Keys that cannot be encoded (lone surrogates) must be refused before anything is
  written.
* **a ``file://`` remote through the daemon**: real file names with newlines, look-alikes, shell metacharacters,
  255-byte names, case variants, leading dashes; a name that is not valid UTF-8 gets its own test.
* **S3 (moto) through the daemon**: keys with ``../``, a leading ``/``, 1,000 bytes, newlines, percent escapes.

NUL cannot be in an S3 key nor a file name: it goes through the ``CacheWriter`` only.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import ClientError

from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.store import CacheStore
from cachefeed._cache.writer import CacheWriter
from cachefeed._testing.daemon import BUCKET, DaemonProcess, start_daemon, write_config
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.samples import npy_bytes, payload
from cachefeed._trainer import SnapshotDataset
from tests.reliability.common import check_cache, report, tree_listing
from tests.support.cache_helpers import cache_config

PAYLOAD_BYTES = 48

FRAGMENTS = [
    "../",
    "../../../../../../etc/passwd",
    "..",
    ".",
    "/",
    "//",
    "/etc/passwd",
    "/tmp/x",
    "a/../../b",
    "..\\..\\x",
    "\x00",
    "a\x00b",
    "\x00/../",
    "\n",
    "a\nb",
    "\r\n",
    "\t",
    "\x1b[2J",
    "\u2028",
    "\u0085",
    "pаypal",
    "paypal",
    "ｆｕｌｌ",
    "／etc／passwd",
    "\u202eevil",
    "a\u200db",
    "e\u0301",
    "é",
    "ﬁle",
    "file",
    "Ω",
    "Ω",
    "Key",
    "key",
    "KEY",
    "kEy",
    "$(rm -rf ~)",
    "`id`",
    "a;b|c&d>e<f",
    "*?[]{}",
    "'\"",
    "~",
    "-rf",
    "--help",
    "%2e%2e%2f",
    "%00",
    "CON",
    "NUL",
    "aux.txt",
    "🙂",
    "\ufeff",
    "\uffff",
    " ",
    "",
    "k" * 1000,
    "é" * 500,
    "/" * 300,
]


def hostile_keys(count: int) -> list[str]:
    """``count`` distinct hostile keys, deterministic: fragments alone, then combined with an index."""
    keys: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(keys) < count:
        fragment = FRAGMENTS[i % len(FRAGMENTS)]
        other = FRAGMENTS[(i * 7 + 3) % len(FRAGMENTS)]
        form = (i // len(FRAGMENTS)) % 4
        candidate = [fragment, f"{fragment}{i}", f"{i}{fragment}{other}", f"{other}/{i}/{fragment}"][form]
        if i < len(FRAGMENTS):
            candidate = fragment
        if candidate not in seen:
            seen.add(candidate)
            keys.append(candidate)
        i += 1
    return keys


def through_the_writer(tmp_path: Path, count: int) -> None:
    sandbox = tmp_path / "sandbox"
    root = sandbox / "deep" / "cache"
    root.mkdir(parents=True)
    outside_before = tree_listing(tmp_path, skip=[root])
    keys = hostile_keys(count)
    refused: list[str] = []
    store = CacheStore(cache_config(root, max_bytes=256 << 20, turnover_bytes=16 << 20, segment_bytes=1 << 20))
    with CacheWriter(store, segment_bytes=1 << 20, fsync=False) as writer:
        for key in keys:
            writer.add({"__key__": key, "data": payload(key, PAYLOAD_BYTES)})
        for bad in ("\udcff", "a\ud800b", "../\udfff"):  # lone surrogates: no UTF-8 for them
            try:
                writer.add({"__key__": bad, "data": payload(bad, PAYLOAD_BYTES)})
            except (ValueError, TypeError):
                refused.append(bad)
    store.close()

    served: dict[str, int] = {}
    wrong = 0
    with Snapshot.create(root, "hostile") as snapshot:
        dataset = SnapshotDataset.from_snapshot(snapshot)
        try:
            for start in range(0, len(dataset), 512):
                for sample in dataset.__getitems__(list(range(start, min(start + 512, len(dataset))))):
                    key = sample["__key__"]
                    served[key] = served.get(key, 0) + 1
                    wrong += not np.array_equal(np.asarray(sample["data"]), payload(key, PAYLOAD_BYTES))
            skipped = dataset.skipped
        finally:
            dataset.close()
    outside_after = tree_listing(tmp_path, skip=[root])
    foreign = [
        path
        for path in tree_listing(root)
        if not re.fullmatch(r"CACHEDIR\.TAG|lock|budget\.json|segments|tmp|snapshots|segments/[0-9a-f]{16}\.seg", path)
    ]
    missing = [key for key in keys if served.get(key) != 1]
    violations = wrong + skipped + len(missing) + len(foreign) + int(outside_after != outside_before)
    violations += sum(1 for bad in refused if bad in served) + (3 - len(refused))
    report(
        "hostile-keys-writer",
        keys=len(keys),
        longest_key_bytes=max(len(k.encode("utf-8", "surrogatepass")) for k in keys),
        with_nul=sum("\x00" in k for k in keys),
        with_dotdot=sum(".." in k for k in keys),
        samples_verified=sum(served.values()) - wrong,
        refused_unencodable=len(refused),
        violations=violations,
    )
    assert wrong == 0 and skipped == 0
    assert not missing, [repr(k) for k in missing[:5]]
    assert set(served) == set(keys)
    assert foreign == [], foreign[:5]
    assert outside_after == outside_before
    assert len(refused) == 3


def test_10000_hostile_keys_through_the_writer(tmp_path: Path) -> None:
    through_the_writer(tmp_path, 10_000)


@pytest.mark.slow
def test_100000_hostile_keys_through_the_writer(tmp_path: Path) -> None:
    through_the_writer(tmp_path, 100_000)


# ------------------------------------------------------------------------------------------------ the daemon

NAME_FRAGMENTS = [
    "a\nb",
    "\r",
    "\t",
    "pаypal",
    "paypal",
    "ｆｕｌｌ",
    "\u202eevil",
    "a\u200db",
    "e\u0301",
    "é",
    "ﬁle",
    "Key",
    "key",
    "KEY",
    "$(touch pwned)",
    "`id`",
    "a;b|c&d>e<f",
    "*?[]{}",
    "'\"",
    "~",
    "-rf",
    "--help",
    "%2e%2e%2f",
    "..",
    ".hidden",
    " lead",
    "trail ",
    "🙂",
    "\\",
    "CON",
    "\x01",
    "\x7f",
]


def daemon_for(tmp_path: Path, url: str, options: dict[str, Any] | None, cache_dir: Path) -> DaemonProcess:
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint="",
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={"remote": {"url": url, "refresh_interval": "1s"}},
    )
    if options is None:  # a local remote: no storage options at all
        text = config.read_text().splitlines()
        config.write_text("\n".join(line for line in text if not line.startswith("storage_options")) + "\n")
    return start_daemon(config, cache_dir, tmp_path / "daemon.stderr")


def run_and_check(proc: DaemonProcess, expected: set[str], scenario: str, **figures: Any) -> None:
    try:
        deadline = time.monotonic() + 60
        found = check_cache(proc.cache_dir)
        while not expected <= set(found.keys) and time.monotonic() < deadline:
            if proc.process.poll() is not None:
                break
            time.sleep(0.5)
            found = check_cache(proc.cache_dir)
        alive = proc.process.poll() is None
        if alive:
            assert proc.stop() == 0
    finally:
        if proc.process.poll() is None:
            proc.kill_group()
    foreign = [
        path
        for path in tree_listing(proc.cache_dir)
        if not re.fullmatch(
            r"CACHEDIR\.TAG|lock|status\.json|budget\.json|made_with\.json|catalog-[0-9a-f]{8}\.cfcat"
            r"|pass-[0-9a-f]{8}\.cfpass|segments|tmp|snapshots"
            r"|segments/[0-9a-f]{16}\.seg|tmp/sampler-[0-9]+\.writing",
            path,
        )
    ]
    served = {key: found.keys.count(key) for key in expected}
    report(
        scenario,
        keys=len(expected),
        samples_verified=found.samples - len(found.problems),
        violations=len(found.problems) + len(foreign) + sum(n != 1 for n in served.values()) + int(not alive),
        **figures,
    )
    assert alive, proc.stderr()[-3000:]
    assert not found.problems, found.problems[:5]
    assert all(n == 1 for n in served.values()), {k: n for k, n in served.items() if n != 1}
    assert set(found.keys) == expected
    assert foreign == [], foreign


def test_hostile_file_names_through_a_local_remote(tmp_path: Path) -> None:
    world = tmp_path / "world"  # the remote and the cache; nothing else may appear or change in here
    remote = world / "remote"
    (remote / "sub dir" / "$(id)").mkdir(parents=True)
    cache_dir = world / "deep" / "cache"
    cache_dir.mkdir(parents=True)  # its parent does not change when the daemon fills it
    expected = set()
    for i, fragment in enumerate(NAME_FRAGMENTS * 2):
        folder = remote if i % 2 else remote / "sub dir" / "$(id)"
        path = folder / f"{fragment}-{i}-{PAYLOAD_BYTES}.npy"
        path.write_bytes(npy_bytes(payload(str(path), PAYLOAD_BYTES)))
        expected.add(str(path))
    long_name = remote / ("L" * (255 - len(f"-{PAYLOAD_BYTES}.npy")) + f"-{PAYLOAD_BYTES}.npy")  # NAME_MAX
    long_name.write_bytes(npy_bytes(payload(str(long_name), PAYLOAD_BYTES)))
    expected.add(str(long_name))
    before = tree_listing(world, skip=[cache_dir])
    proc = daemon_for(tmp_path, f"file://{remote}", None, cache_dir)
    run_and_check(proc, expected, "hostile-keys-file-remote")
    assert tree_listing(world, skip=[cache_dir]) == before


def test_hostile_keys_through_s3(tmp_path: Path, s3: LocalS3, bucket: Any) -> None:
    keys = [
        "../escape",
        "../../../../etc/passwd-x",
        "/etc/passwd-y",
        "a/../../b",
        "./dot",
        "dir//double",
        "a\nb",
        "tab\tkey",
        "pаypal",
        "paypal",
        "Key",
        "key",
        "KEY",
        "$(touch pwned)",
        "`id`",
        "a;b|c&d",
        "%2e%2e%2f",
        "%00",
        "🙂",
        "\u202eevil",
        "e\u0301",
        "é",
        " lead",
        "-rf",
        "k" * 980,
    ]
    expected = set()
    refused = []
    for i, key in enumerate(keys):
        full = f"{key}-{i}-{PAYLOAD_BYTES}.npy"
        try:
            bucket.put_object(Bucket=BUCKET, Key=full, Body=npy_bytes(payload(f"{BUCKET}/{full}", PAYLOAD_BYTES)))
        except ClientError:  # what the S3 API (moto behind botocore) cannot hold is not ours to test
            refused.append(full)
            continue
        expected.add(f"{BUCKET}/{full}")
    listed = {f"{BUCKET}/{o['Key']}" for o in bucket.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert listed == expected, "moto keeps every key it accepted as given"
    world = tmp_path / "world"
    cache_dir = world / "deep" / "cache"
    cache_dir.mkdir(parents=True)
    before = tree_listing(world, skip=[cache_dir])
    config = write_config(
        tmp_path / "daemon.toml",
        endpoint=s3.endpoint,
        bucket=BUCKET,
        cache_dir=cache_dir,
        sections={"remote": {"refresh_interval": "1s"}},
    )
    proc = start_daemon(config, cache_dir, tmp_path / "daemon.stderr")
    run_and_check(proc, expected, "hostile-keys-s3", refused_by_s3=[repr(k[:20]) for k in refused])
    assert tree_listing(world, skip=[cache_dir]) == before


def test_a_file_name_that_is_not_utf8_is_skipped_not_fatal(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    expected = set()
    for i in range(6):
        path = remote / f"good-{i}-{PAYLOAD_BYTES}.npy"
        path.write_bytes(npy_bytes(payload(str(path), PAYLOAD_BYTES)))
        expected.add(str(path))
    bad = os.fsencode(remote) + b"/\xff\xfe-bad-" + str(PAYLOAD_BYTES).encode() + b".npy"
    with open(bad, "wb") as handle:
        handle.write(npy_bytes(payload("bad", PAYLOAD_BYTES)))
    cache_dir = tmp_path / "cache"
    proc = daemon_for(tmp_path, f"file://{remote}", None, cache_dir)
    run_and_check(proc, expected, "hostile-keys-not-utf8")
