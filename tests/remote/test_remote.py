"""The remote transport against a real S3 API (moto) behind the counting, fault-injecting proxy, and local files."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import random
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import fsspec
import pytest
from botocore.exceptions import ClientError, NoCredentialsError, ReadTimeoutError

from cachefeed._config import RemoteConfig
from cachefeed._errors import (
    ConfigError,
    RemoteChangedError,
    RemoteError,
    RemoteForbiddenError,
    RemoteNotFoundError,
    RemoteTransientError,
)
from cachefeed._remote import Remote, RemoteObject
from cachefeed._remote.errors import translate_error
from cachefeed._remote.limits import backoff_delay
from cachefeed._remote.listing import Pager
from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.proxy import FaultProxy, Rule

T = TypeVar("T")
BUCKET = "data"
PREFIX = "set"


@pytest.fixture
def proxy(s3: LocalS3, fault_proxy: FaultProxy) -> FaultProxy:
    """The proxy in front of moto, with the bucket created (directly: not counted)."""
    s3.client().create_bucket(Bucket=BUCKET)
    return fault_proxy


@pytest.fixture
def remotes() -> Iterator[list[Remote]]:
    made: list[Remote] = []
    yield made
    for remote in made:
        remote.close()


@pytest.fixture
def make_remote(proxy: FaultProxy, remotes: list[Remote]) -> Callable[..., Remote]:
    def make(
        *, share: float = 1.0, retry_budget_burst: float = 10.0, options: dict[str, Any] | None = None, **fields: Any
    ) -> Remote:
        fields.setdefault("backoff_base_s", 0.001)
        fields.setdefault("backoff_max_s", 0.01)
        storage = options or {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
        config = RemoteConfig(url=f"s3://{BUCKET}/{PREFIX}", storage_options=storage, **fields)
        remote = Remote(config, share=share, retry_budget_burst=retry_budget_burst, rng=random.Random(7))
        remotes.append(remote)
        return remote

    return make


def put(s3: LocalS3, name: str, body: bytes) -> None:
    s3.client().put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}", Body=body)


def run(remote: Remote, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` on a fresh event loop, closing the remote's sessions on that loop afterwards."""

    async def main() -> T:
        try:
            return await work()
        finally:
            await remote.aclose()

    return asyncio.run(main())


def fetch_one(remote: Remote, obj: RemoteObject) -> bytes:
    return run(remote, lambda: remote.fetch(obj))


def object_gets(proxy: FaultProxy) -> int:
    return proxy.counts().ops.get("GetObject", 0)


# ---------------------------------------------------------------------------------------------------- listing


def test_list_returns_matching_objects_sorted_with_sizes_and_etags(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    for name in ["b/002.npy", "a/001.npy", "000.npy", "notes.txt", "a/deep/003.npy"]:
        put(s3, name, name.encode() * 3)
    s3.client().put_object(Bucket=BUCKET, Key="elsewhere/004.npy", Body=b"outside the prefix")
    remote = make_remote(pattern="**/*.npy")

    objects = remote.list_objects()

    names = ["000.npy", "a/001.npy", "a/deep/003.npy", "b/002.npy"]
    assert [obj.path for obj in objects] == [f"{BUCKET}/{PREFIX}/{name}" for name in names]
    for obj, name in zip(objects, names, strict=True):
        head = s3.client().head_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}")
        assert obj.size == len(name.encode() * 3)
        assert obj.etag == head["ETag"]
    assert proxy.counts().method("HEAD") == 0
    assert proxy.counts().objects == 0  # only bucket-level listing requests


def test_list_pattern_star_star_takes_everything_and_refresh_sees_new_objects(
    s3: LocalS3, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "x.bin", b"1")
    remote = make_remote()
    assert [obj.path for obj in remote.list_objects()] == [f"{BUCKET}/{PREFIX}/x.bin"]

    put(s3, "sub/y.bin", b"22")
    assert [obj.path for obj in remote.list_objects()] == [f"{BUCKET}/{PREFIX}/sub/y.bin", f"{BUCKET}/{PREFIX}/x.bin"]
    assert remote.stats.listings_total == 2


def test_an_s3_listing_requests_the_urls_directory_never_its_siblings(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    for name in ["a.npy", "sub/b.npy"]:
        put(s3, name, b"x")
    for sibling in [f"{PREFIX}.cfcatalog/LATEST", f"{PREFIX}-v2/c.npy", f"{PREFIX}x.npy"]:
        s3.client().put_object(Bucket=BUCKET, Key=sibling, Body=b"not ours")
    queries: list[str] = []
    proxy.set_rules([Rule("latency", op="ListObjectsV2", callback=lambda info: queries.append(info.query))])
    remote = make_remote()

    assert [obj.path for obj in remote.list_objects()] == [f"{BUCKET}/{PREFIX}/a.npy", f"{BUCKET}/{PREFIX}/sub/b.npy"]
    assert len(queries) == 1 and f"prefix={PREFIX}%2F" in queries[0], queries


def test_an_s3_url_naming_one_object_lists_that_object_only(
    s3: LocalS3, proxy: FaultProxy, remotes: list[Remote]
) -> None:
    s3.client().put_object(Bucket=BUCKET, Key="one.npy", Body=b"1")
    s3.client().put_object(Bucket=BUCKET, Key="one.npy.bak", Body=b"22")
    storage = {"endpoint_url": proxy.endpoint, "key": "testing", "secret": "testing"}
    remote = Remote(RemoteConfig(url=f"s3://{BUCKET}/one.npy", storage_options=storage))
    remotes.append(remote)
    assert [(obj.path, obj.size) for obj in remote.list_objects()] == [(f"{BUCKET}/one.npy", 1)]
    assert proxy.counts().ops.get("ListObjectsV2") == 2  # the directory "one.npy/" (empty), then the key itself


def test_a_stream_cut_mid_body_or_failing_with_5xx_is_read_on_from_where_it_was(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    body = random.Random(3).randbytes(4 << 20)  # 16 blocks of 256 KiB
    put(s3, "big.bin", body)
    proxy.set_rules(
        [
            Rule("latency", op="GetObject", max_count=8),  # the first half goes through
            Rule("reset", op="GetObject", body_fraction=0.5, max_count=1),  # then a block is cut half way
            Rule("error500", op="GetObject", max_count=1),  # and its retry answered 500
        ]
    )
    remote = make_remote(max_attempts=3)
    with Pager(remote, lambda page: None).open(
        remote.listing_fs(), f"{BUCKET}/{PREFIX}/big.bin", block_size=256 << 10
    ) as f:
        assert f.read(1000) == body[:1000]
        assert f.read() == body[1000:]
    counts = proxy.counts()
    assert counts.fault("reset") == 1 and counts.fault("error500") == 1
    assert counts.ops["GetObject"] <= 16 + 2 + 1  # 16 blocks, the two failures, at most one block again


def test_a_stream_failing_past_max_attempts_raises_the_remotes_transient_error(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "keys.txt", b"a\t1\n" * 1000)
    proxy.set_rules([Rule("reset", op="GetObject", body_fraction=0.5)])
    remote = make_remote(max_attempts=2)
    with (
        pytest.raises(RemoteTransientError),
        Pager(remote, lambda page: None).open(remote.listing_fs(), f"{BUCKET}/{PREFIX}/keys.txt") as f,
    ):
        f.read()


def test_a_manifest_read_through_a_reset_lists_every_key_once(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    keys = [f"k{i:05d}.npy" for i in range(3000)]
    s3.client().put_object(Bucket=BUCKET, Key="keys.txt", Body="".join(f"{k}\t1\n" for k in keys).encode())
    proxy.set_rules([Rule("reset", op="GetObject", key="keys.txt", body_fraction=0.5, max_count=1)])
    remote = make_remote(manifest=f"s3://{BUCKET}/keys.txt", max_attempts=3)
    listed = [obj.path for obj in remote.list_objects()]
    assert sorted(listed) == [f"{BUCKET}/{PREFIX}/{k}" for k in keys]
    assert proxy.counts().fault("reset") == 1


def test_listing_a_missing_bucket_is_not_found(proxy: FaultProxy, remotes: list[Remote]) -> None:
    config = RemoteConfig(url="s3://no-such-bucket/x", storage_options={"endpoint_url": proxy.endpoint}, max_attempts=3)
    remote = Remote(config)
    remotes.append(remote)
    with pytest.raises(RemoteNotFoundError, match="no-such-bucket"):
        remote.list_objects()
    assert proxy.counts().method("GET") == 1  # not retried


def test_listing_transient_failure_is_retried_by_cachefeed_only(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "x.bin", b"1")
    proxy.set_rules([Rule("slowdown", query="list-type")])
    remote = make_remote(max_attempts=3)
    with pytest.raises(RemoteTransientError):
        remote.list_objects()
    assert proxy.counts().method("GET") == 3  # max_attempts, and nothing below multiplies them

    proxy.reset_counts()
    proxy.set_rules([Rule("error500", query="list-type", max_count=1)])
    assert len(remote.list_objects()) == 1
    assert proxy.counts().method("GET") == 2


# ---------------------------------------------------------------------------------------------------- fetching


def test_fetch_sends_exactly_one_get_and_no_head_per_object(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    bodies = {f"{i:03d}.npy": os.urandom(100 + i) for i in range(20)}
    for name, body in bodies.items():
        put(s3, name, body)
    remote = make_remote()
    objects = remote.list_objects()
    proxy.reset_counts()

    async def fetch_all() -> list[bytes]:
        return await asyncio.gather(*(remote.fetch(obj) for obj in objects))

    fetched = run(remote, fetch_all)

    assert fetched == list(bodies.values())
    assert object_gets(proxy) == 20
    assert proxy.counts().method("HEAD") == 0
    assert proxy.counts().total == 20
    assert remote.stats.requests_total == 20
    assert remote.stats.bytes_total == sum(len(body) for body in bodies.values())
    assert remote.stats.retries_total == 0


def test_deleted_object_is_not_found_and_not_retried(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "gone.npy", b"soon gone")
    remote = make_remote(max_attempts=5)
    (obj,) = remote.list_objects()
    s3.client().delete_object(Bucket=BUCKET, Key=f"{PREFIX}/gone.npy")

    with pytest.raises(RemoteNotFoundError, match=r"gone\.npy"):
        fetch_one(remote, obj)
    assert object_gets(proxy) == 1
    assert remote.stats.errors_total == {"not_found": 1}


def test_forbidden_is_not_retried(s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]) -> None:
    put(s3, "secret.npy", b"x")
    remote = make_remote(max_attempts=5)
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("status", method="GET", key="secret.npy", status=403, code="AccessDenied")])

    with pytest.raises(RemoteForbiddenError):
        fetch_one(remote, obj)
    assert object_gets(proxy) == 1
    assert remote.stats.errors_total == {"forbidden": 1}


def test_object_replaced_after_listing_is_changed_412_not_retried(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "v.npy", b"version one")
    remote = make_remote(max_attempts=5)
    (obj,) = remote.list_objects()
    put(s3, "v.npy", b"version two")  # same size, new ETag

    with pytest.raises(RemoteChangedError):
        fetch_one(remote, obj)
    assert object_gets(proxy) == 1
    assert remote.stats.errors_total == {"changed": 1}


def test_body_length_differing_from_listing_is_changed(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "v.npy", b"12345")
    remote = make_remote()
    (obj,) = remote.list_objects()
    stale = RemoteObject(obj.path, obj.size + 1, obj.etag)  # a listing that disagrees with the object
    with pytest.raises(RemoteChangedError, match="listed 6"):
        fetch_one(remote, stale)


def test_transient_errors_are_retried_with_backoff_until_success(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "flaky.npy", b"worth the wait")
    remote = make_remote(max_attempts=5)
    (obj,) = remote.list_objects()
    proxy.set_rules(
        [
            Rule("slowdown", method="GET", key="flaky", max_count=1),
            Rule("error500", method="GET", key="flaky", max_count=1),
        ]
    )

    assert fetch_one(remote, obj) == b"worth the wait"
    assert object_gets(proxy) == 3
    assert remote.stats.retries_total == 2
    assert remote.stats.errors_total == {"transient": 2}


def test_persistent_transient_error_gives_up_after_max_attempts(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "down.npy", b"x")
    remote = make_remote(max_attempts=4)
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("slowdown", method="GET", key="down")])

    with pytest.raises(RemoteTransientError, match="4 attempts"):
        fetch_one(remote, obj)
    assert object_gets(proxy) == 4  # botocore and s3fs add no attempts of their own
    assert remote.stats.retries_total == 3


def test_single_attempt_means_a_single_request(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "once.npy", b"x")
    remote = make_remote(max_attempts=1)
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("status", method="GET", key="once", status=429, code="TooManyRequests")])
    with pytest.raises(RemoteTransientError):
        fetch_one(remote, obj)
    assert object_gets(proxy) == 1


def test_truncated_body_is_transient_and_retried(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    body = os.urandom(4096)
    put(s3, "cut.npy", body)
    remote = make_remote()
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("truncate", method="GET", key="cut", max_count=1)])

    assert fetch_one(remote, obj) == body
    assert object_gets(proxy) == 2
    assert remote.stats.errors_total == {"transient": 1}


def test_body_corrupted_in_transit_is_caught_by_the_checksum_and_retried(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    body = os.urandom(2048)
    put(s3, "rot.npy", body)  # boto3 uploads with a CRC32 that S3 returns when asked (x-amz-checksum-mode)
    remote = make_remote()
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("corrupt", method="GET", key="rot", max_count=1)])

    assert fetch_one(remote, obj) == body
    assert object_gets(proxy) == 2
    assert remote.stats.errors_total == {"transient": 1}


def test_read_timeout_is_transient_and_retried(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "slow.npy", b"eventually")
    # 2 s: the retry, a healthy GET through the proxy and moto, must beat it on a loaded machine too (0.2 s left
    # it a fifth of a second; a second timeout counts a second retry)
    remote = make_remote(read_timeout_s=2.0)
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("latency", delay_s=30.0, method="GET", key="slow", max_count=1)])

    started = time.monotonic()
    assert fetch_one(remote, obj) == b"eventually"
    assert time.monotonic() - started < 15.0  # the timeout fired, the 30 s reply was not awaited (loose: CI is busy)
    assert remote.stats.retries_total == 1


def test_connection_reset_is_transient_and_resent_at_most_once_by_aiohttp(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    put(s3, "reset.npy", b"x")
    remote = make_remote(max_attempts=2)
    (obj,) = remote.list_objects()
    proxy.set_rules([Rule("reset", method="GET", key="reset")])
    with pytest.raises(RemoteTransientError):
        fetch_one(remote, obj)
    # NOTE [ One retry layer ]: aiohttp re-sends once on a dropped connection; nothing else multiplies attempts.
    assert 2 <= object_gets(proxy) <= 2 * 2
    assert remote.stats.requests_total == 2

    proxy.set_rules([Rule("reset", method="GET", key="reset", max_count=3)])
    assert fetch_one(remote, obj) == b"x"


def test_retry_budget_bounds_the_load_on_a_failing_remote(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    for i in range(6):
        put(s3, f"{i}.npy", b"x")
    remote = make_remote(max_attempts=5, retry_budget=0.0, retry_budget_burst=2)
    objects = remote.list_objects()
    proxy.set_rules([Rule("slowdown", method="GET", key=f"{PREFIX}/")])

    async def fetch_all() -> list[BaseException | bytes]:
        results: list[BaseException | bytes] = []
        for obj in objects:
            try:
                results.append(await remote.fetch(obj))
            except RemoteError as exc:
                results.append(exc)
        return results

    results = run(remote, fetch_all)
    assert all(isinstance(result, RemoteTransientError) for result in results)
    assert object_gets(proxy) == 6 + 2  # one attempt each, plus the burst of two retries
    assert remote.stats.retries_total == 2
    assert remote.stats.budget_exhausted_total == 6


def test_credentials_never_appear_in_errors_tracebacks_or_logs(
    s3: LocalS3, proxy: FaultProxy, remotes: list[Remote], caplog: pytest.LogCaptureFixture
) -> None:
    sentinels = {"key": "AKIASENTINELKEY0001", "secret": "sentinel-secret-4f1d", "token": "sentinel-token-9c2e"}
    put(s3, "a.npy", b"x")
    config = RemoteConfig(
        url=f"s3://{BUCKET}/{PREFIX}",
        storage_options={"endpoint_url": proxy.endpoint, **sentinels},
        max_attempts=2,
        backoff_base_s=0.001,
    )
    remote = Remote(config)
    remotes.append(remote)
    caplog.set_level(logging.DEBUG, logger="cachefeed")
    (obj,) = remote.list_objects()

    # The server echoes the Authorization header and session token, as S3's SignatureDoesNotMatch does.
    proxy.set_rules(
        [
            Rule(
                "status",
                op="GetObject",
                key="a.npy",
                status=403,
                code="SignatureDoesNotMatch",
                echo_auth=True,
                max_count=1,
            ),
            Rule("slowdown", method="GET", key="a.npy", echo_auth=True),
            Rule("status", query="list-type", status=403, code="AccessDenied", echo_auth=True),
        ]
    )
    errors: list[BaseException] = []
    for attempt in (lambda: fetch_one(remote, obj), lambda: fetch_one(remote, obj), remote.list_objects):
        with pytest.raises(RemoteError) as caught:
            attempt()
        errors.append(caught.value)
    assert [type(error) for error in errors] == [RemoteForbiddenError, RemoteTransientError, RemoteForbiddenError]

    texts = [str(error) + repr(error) + "".join(traceback.format_exception(error)) for error in errors]
    texts += [record.getMessage() for record in caplog.records]
    for text in texts:
        for secret in sentinels.values():
            assert secret not in text
    assert "a.npy" in texts[0]


# ---------------------------------------------------------------------------------------------------- rate caps


def test_request_rate_cap_is_scaled_by_share(
    s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]
) -> None:
    for i in range(6):
        put(s3, f"{i}.npy", b"x")
    remote = make_remote(max_requests_per_s=20.0, share=0.5)  # 10 requests/s for this process, burst of 1
    objects = remote.list_objects()

    async def fetch_all() -> list[bytes]:
        return await asyncio.gather(*(remote.fetch(obj) for obj in objects))

    started = time.monotonic()
    run(remote, fetch_all)
    assert time.monotonic() - started >= 0.45  # 5 requests beyond the burst, 0.1 s apart
    assert remote.stats.throttled_s > 0


def test_byte_rate_cap(s3: LocalS3, proxy: FaultProxy, make_remote: Callable[..., Remote]) -> None:
    for i in range(5):
        put(s3, f"{i}.npy", os.urandom(1000))
    remote = make_remote(max_bytes_per_s=10_000)  # burst 1000 bytes: one object
    objects = remote.list_objects()

    async def fetch_all() -> list[bytes]:
        return await asyncio.gather(*(remote.fetch(obj) for obj in objects))

    started = time.monotonic()
    assert sum(len(body) for body in run(remote, fetch_all)) == 5000
    assert time.monotonic() - started >= 0.35  # 4000 bytes beyond the burst at 10 kB/s


# ---------------------------------------------------------------------------------------------------- other protocols


def test_local_files_list_fetch_and_detect_changes(tmp_path: Path, remotes: list[Remote]) -> None:
    (tmp_path / "a" / "deep").mkdir(parents=True)
    files = {"000.npy": b"zero", "a/001.npy": b"one!", "a/deep/002.npy": b"two!!", "a/skip.txt": b"no"}
    for name, body in files.items():
        (tmp_path / name).write_bytes(body)
    remote = Remote(RemoteConfig(url=f"file://{tmp_path}", pattern="**/*.npy", max_attempts=3))
    remotes.append(remote)

    objects = remote.list_objects()
    assert [obj.path for obj in objects] == [
        str(tmp_path / name) for name in ["000.npy", "a/001.npy", "a/deep/002.npy"]
    ]
    stat = (tmp_path / "000.npy").stat()
    assert objects[0].etag == f"{int(stat.st_mtime * 1e9)}-{stat.st_size}"

    async def fetch_all() -> list[bytes]:
        return [await remote.fetch(obj) for obj in objects]

    assert run(remote, fetch_all) == [b"zero", b"one!", b"two!!"]

    (tmp_path / "000.npy").write_bytes(b"ZERO")  # same size, new mtime
    os.utime(tmp_path / "000.npy", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(RemoteChangedError):
        fetch_one(remote, objects[0])
    (tmp_path / "a" / "001.npy").unlink()
    with pytest.raises(RemoteNotFoundError):
        fetch_one(remote, objects[1])
    assert remote.stats.retries_total == 0


def test_memory_filesystem(remotes: list[Remote]) -> None:
    root = f"/cachefeed-test-{uuid.uuid4().hex}"
    memory = fsspec.filesystem("memory")
    memory.pipe({f"{root}/x/1.bin": b"one", f"{root}/2.bin": b"two!"})
    try:
        remote = Remote(RemoteConfig(url=f"memory://{root}"))
        remotes.append(remote)
        objects = remote.list_objects()
        assert [(obj.path, obj.size) for obj in objects] == [(f"{root}/2.bin", 4), (f"{root}/x/1.bin", 3)]
        assert all(obj.etag for obj in objects)

        async def fetch_all() -> list[bytes]:
            return [await remote.fetch(obj) for obj in objects]

        assert run(remote, fetch_all) == [b"two!", b"one"]
    finally:
        memory.rm(root, recursive=True)


# ---------------------------------------------------------------------------------------------------- units


def test_backoff_is_full_jitter_exponential_and_capped() -> None:
    rng = random.Random(1)
    for retry in range(12):
        cap = min(2.0, 0.1 * 2**retry)
        draws = [backoff_delay(retry, 0.1, 2.0, rng) for _ in range(300)]
        assert all(0.0 <= draw <= cap for draw in draws)
        assert max(draws) > 0.8 * cap and min(draws) < 0.2 * cap  # spread over the whole range
    assert backoff_delay(10_000, 0.1, 2.0, rng) <= 2.0


def _client_error(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (_client_error(404, "NoSuchKey"), RemoteNotFoundError),
        (_client_error(403, "AccessDenied"), RemoteForbiddenError),
        (_client_error(401, "Unauthorized"), RemoteForbiddenError),
        (_client_error(412, "PreconditionFailed"), RemoteChangedError),
        (_client_error(503, "SlowDown"), RemoteTransientError),
        (_client_error(400, "ThrottlingException"), RemoteTransientError),
        (_client_error(502, "SomethingNew"), RemoteTransientError),
        (_client_error(400, "InvalidArgument"), RemoteError),
        (_client_error(400, "ExpiredToken"), RemoteTransientError),  # a refresh's moment: the object is not at fault
        (NoCredentialsError(), RemoteTransientError),  # an instance-metadata hiccup, likewise
        (FileNotFoundError(2, "No such file"), RemoteNotFoundError),
        (PermissionError(13, "Permission denied"), RemoteForbiddenError),
        (ConnectionResetError(104, "reset"), RemoteTransientError),
        (TimeoutError(), RemoteTransientError),
        (aiohttp.ClientPayloadError("cut"), RemoteTransientError),
        (aiohttp.ServerDisconnectedError(), RemoteTransientError),
        (ReadTimeoutError(endpoint_url="http://x"), RemoteTransientError),
        (ValueError("a bug"), RemoteError),
    ],
)
def test_translation_table(exc: BaseException, kind: type[RemoteError]) -> None:
    error = translate_error(exc, "bucket/key")
    assert type(error) is kind
    assert "bucket/key" in str(error)


def test_no_credentials_says_where_credentials_come_from() -> None:
    """ "NoCredentialsError" alone left a new user guessing; the reason in status and the log says what to set."""
    message = str(translate_error(NoCredentialsError(), "s3://bucket/prefix"))
    assert "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message, message
    assert "remote.storage_options.anon = true for a public bucket" in message


def test_translation_follows_the_cause_chain() -> None:
    wrapped = OSError(5, "s3fs translated it")
    wrapped.__cause__ = _client_error(403, "AccessDenied")
    assert type(translate_error(wrapped, "k")) is RemoteForbiddenError


def test_remote_refuses_pickling_bad_share_and_unknown_protocols() -> None:
    config = RemoteConfig(url="memory://x")
    with pytest.raises(TypeError, match="inside the process"):
        pickle.dumps(Remote(config))
    with pytest.raises(ValueError, match="share"):
        Remote(config, share=0.0)
    with pytest.raises(ConfigError, match=r"remote\.url") as caught:
        Remote(RemoteConfig(url="nosuchprotocol://user:pw-sentinel@host/x"))
    assert "pw-sentinel" not in str(caught.value)


@pytest.mark.parametrize(
    ("response", "checked"),
    [
        ({"ETag": '"0123456789abcdef0123456789abcdef"'}, True),  # single-part upload: the ETag is the MD5
        ({"ETag": '"0123456789abcdef0123456789abcdef-3"'}, False),  # multipart: an MD5 of part MD5s
        ({"ETag": '"0123456789abcdef0123456789abcdef"', "ServerSideEncryption": "aws:kms"}, False),
        ({"ETag": '"0123456789abcdef0123456789abcdef"', "SSECustomerAlgorithm": "AES256"}, False),
        ({"ETag": '"0123456789abcdef0123456789abcdef"', "ChecksumCRC32": "AAAAAA=="}, False),  # botocore checked
        ({"ETag": '"0123456789abcdef0123456789abcdef"', "ServerSideEncryption": "AES256"}, True),  # SSE-S3 keeps MD5
        ({"ETag": "W/not-an-md5"}, False),
    ],
)
def test_the_etag_is_used_as_an_md5_only_where_it_is_one(response: dict, checked: bool) -> None:
    from cachefeed._remote.integrity import etag_is_md5

    assert etag_is_md5(response) is checked


def test_a_misspelt_s3_option_is_a_config_error_at_start_naming_it(tmp_path: Path) -> None:
    """``storage_options = { endpoint = ... }`` (for ``endpoint_url``) was retried forever as an "unexpected
    TypeError" while listing. botocore refuses it when the session is built, before the daemon is ready: one
    line, exit 78, naming the option and botocore's words."""
    from cachefeed._config import toml_text
    from tests.support.cli import run_cli

    config = tmp_path / "d.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": "s3://bucket/prefix", "storage_options": {"endpoint": "http://127.0.0.1:9"}},
                "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "64MiB", "segment_bytes": "1MiB"},
            }
        )
    )
    dummy = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "BOTO_CONFIG": "/dev/null"}
    done = run_cli("daemon", "--config", str(config), timeout_s=120, **dummy)
    assert done.returncode == 78, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "remote.storage_options = {endpoint} rejected by S3FileSystem" in line, line
    assert "unexpected keyword argument 'endpoint'" in line, line


def test_what_an_ftp_url_says_is_given_to_its_filesystem_and_its_password_kept_out_of_messages() -> None:
    """An ``ftp://user:password@host:port/path`` remote was made without the URL's host (fsspec's own
    ``url_to_fs`` passes it), so it could never list: a TypeError, retried forever."""
    remote = Remote(RemoteConfig(url="ftp://reader:s3kr1t-pass@ftp.example.invalid:2121/data"))
    options = remote._options
    assert (options["host"], options["port"], options["username"]) == ("ftp.example.invalid", 2121, "reader")
    message = remote._rejected(TypeError("bad option s3kr1t-pass"))
    assert "s3kr1t-pass" not in message and "FTPFileSystem" in message, message
