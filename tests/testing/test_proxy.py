"""The fault proxy (``cachefeed._testing.proxy``) and the tmpfs helpers, proved through real clients.

Clients are boto3 with one attempt (no retries), so each test reads exactly what a client sees, and s3fs, which
the daemon uses. Objects are put straight into moto, so the proxy's counts hold only what a test sends.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import s3fs

from cachefeed._testing.local_s3 import LocalS3
from cachefeed._testing.proxy import FaultProxy, ProxyCounts, RequestInfo, Rule, classify
from tests.support.tmpfs import small_tmpfs

BUCKET = "faults"
KEY = "dir/object 1.bin"
OTHER = "dir/object-2.bin"
DATA = random.Random(7).randbytes(2 * 1024 * 1024)
CHUNK = 8192


@pytest.fixture
def client(s3: LocalS3, fault_proxy: FaultProxy) -> Any:
    """A no-retry boto3 client through the proxy, with two objects in moto and the counts at zero."""
    direct = s3.client()
    direct.create_bucket(Bucket=BUCKET)
    direct.put_object(Bucket=BUCKET, Key=KEY, Body=DATA)
    direct.put_object(Bucket=BUCKET, Key=OTHER, Body=b"other")
    return fault_proxy.client()


def client_error(exc_info: pytest.ExceptionInfo[botocore.exceptions.ClientError]) -> tuple[int, str]:
    response = exc_info.value.response
    return response["ResponseMetadata"]["HTTPStatusCode"], response["Error"]["Code"]


def read_in_chunks(body: Any) -> tuple[int, BaseException | None]:
    """Read a streaming body ``CHUNK`` bytes at a time: the bytes received before an error, and the error."""
    received = 0
    try:
        while chunk := body.read(CHUNK):
            received += len(chunk)
    except Exception as exc:
        return received, exc
    return received, None


# ------------------------------------------------------------------------------------------ pass-through


def test_passthrough_keeps_bodies_headers_and_counts(s3: LocalS3, fault_proxy: FaultProxy, client: Any) -> None:
    response = client.get_object(Bucket=BUCKET, Key=KEY)
    assert response["Body"].read() == DATA
    assert response["ETag"] == s3.client().head_object(Bucket=BUCKET, Key=KEY)["ETag"]
    assert client.head_object(Bucket=BUCKET, Key=KEY)["ContentLength"] == len(DATA)
    ranged = client.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=10-19")
    assert ranged["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert ranged["Body"].read() == DATA[10:20]
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.get_object(Bucket=BUCKET, Key=KEY, IfMatch='"not-the-etag"')
    assert client_error(exc_info) == (412, "PreconditionFailed")
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="dir/")
    assert [item["Key"] for item in listed["Contents"]] == [KEY, OTHER]
    client.put_object(Bucket=BUCKET, Key="up.bin", Body=DATA)
    assert s3.client().get_object(Bucket=BUCKET, Key="up.bin")["Body"].read() == DATA

    counts = fault_proxy.counts()
    assert counts.request("GET", KEY) == 3
    assert counts.request("HEAD", KEY) == 1
    assert counts.request("PUT", "up.bin") == 1
    assert counts.ops == {"GetObject": 3, "HeadObject": 1, "ListObjectsV2": 1, "PutObject": 1}
    assert counts.total == 6
    assert counts.faults == {}
    fault_proxy.reset_counts()
    assert fault_proxy.counts() == ProxyCounts({}, {}, {})


def test_classify_names_s3_operations() -> None:
    assert classify("GET", "/bkt", "list-type=2&prefix=a").op == "ListObjectsV2"
    assert classify("GET", "/bkt/a/b c", "").key == "a/b c"
    assert classify("PUT", "/bkt/a", "partNumber=1&uploadId=x").op == "UploadPart"
    assert classify("HEAD", "/bkt", "").op == "HeadBucket"


# ------------------------------------------------------------------------------------------ error answers


def test_slowdown_max_count_then_healthy(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("slowdown", max_count=2)])
    for _ in range(2):
        with pytest.raises(botocore.exceptions.ClientError) as exc_info:
            client.get_object(Bucket=BUCKET, Key=KEY)
        assert client_error(exc_info) == (503, "SlowDown")
    assert client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA
    counts = fault_proxy.counts()
    assert counts.request("GET", KEY) == 3
    assert counts.faults == {"slowdown": 2}


def test_slowdown_until_deadline_then_healthy(fault_proxy: FaultProxy, client: Any) -> None:
    until = time.monotonic() + 0.4
    fault_proxy.set_rules([Rule("slowdown", until=until)])
    failures = 0
    deadline = time.monotonic() + 10
    while True:
        try:
            client.head_object(Bucket=BUCKET, Key=KEY)
            break
        except botocore.exceptions.ClientError as exc:
            assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            failures += 1
        assert time.monotonic() < deadline, "the rule never expired"
        time.sleep(0.02)
    assert time.monotonic() >= until
    assert failures >= 1
    assert fault_proxy.counts().fault("slowdown") == failures


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        (Rule("error500"), (500, "InternalError")),
        (Rule("status", status=404), (404, "NoSuchKey")),
        (Rule("status", status=403), (403, "AccessDenied")),
        (Rule("status", status=412), (412, "PreconditionFailed")),
        (Rule("status", status=503, code="ServiceUnavailable"), (503, "ServiceUnavailable")),
    ],
)
def test_error_statuses_carry_s3_error_codes(
    fault_proxy: FaultProxy, client: Any, rule: Rule, expected: tuple[int, str]
) -> None:
    fault_proxy.set_rules([rule])
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.get_object(Bucket=BUCKET, Key=KEY)
    assert client_error(exc_info) == expected
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.head_object(Bucket=BUCKET, Key=KEY)  # HEAD answers carry no body: botocore names the status
    assert client_error(exc_info) == (expected[0], str(expected[0]))
    assert fault_proxy.counts().fault(rule.fault) == 2


def test_echo_auth_puts_the_authorization_header_in_the_error_body(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("status", status=403, code="SignatureDoesNotMatch", echo_auth=True)])
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.get_object(Bucket=BUCKET, Key=KEY)
    assert "Credential=testing/" in str(exc_info.value.response["Error"].get("AWSAccessKeyId"))


# ------------------------------------------------------------------------------------------ broken connections


def test_reset_before_response_on_get_and_put(s3: LocalS3, fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("reset")])
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        client.get_object(Bucket=BUCKET, Key=KEY)
    with pytest.raises(botocore.exceptions.HTTPClientError):
        client.put_object(Bucket=BUCKET, Key="never.bin", Body=DATA)
    with pytest.raises(botocore.exceptions.ClientError):
        s3.client().head_object(Bucket=BUCKET, Key="never.bin")  # the upload never reached moto
    assert fault_proxy.counts().faults == {"reset": 2}


def test_reset_mid_body(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("reset", body_bytes=8 * CHUNK)])
    response = client.get_object(Bucket=BUCKET, Key=KEY)
    assert response["ContentLength"] == len(DATA)
    received, error = read_in_chunks(response["Body"])
    assert received == 8 * CHUNK
    assert isinstance(error, botocore.exceptions.ResponseStreamingError)
    assert "reset" in str(error).lower()


def test_truncate_sends_full_length_but_part_of_the_body(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("truncate", body_bytes=8 * CHUNK, key="object 1")])
    response = client.get_object(Bucket=BUCKET, Key=KEY)
    assert response["ContentLength"] == len(DATA)
    received, error = read_in_chunks(response["Body"])
    assert received == 8 * CHUNK
    # Read in parts, botocore's StreamingBody counts the bytes against Content-Length itself.
    assert isinstance(error, botocore.exceptions.IncompleteReadError)
    # Read whole (the default position: half the body), urllib3 sees the short body first.
    fault_proxy.set_rules([Rule("truncate")])
    with pytest.raises(botocore.exceptions.ResponseStreamingError, match="IncompleteRead"):
        client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    assert fault_proxy.counts().faults == {"truncate": 2}


def test_stall_trips_the_client_read_timeout(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("stall", delay_s=30)])  # the proxy's stop() ends the stall at teardown
    impatient = fault_proxy.client(read_timeout=0.3)
    started = time.monotonic()
    response = impatient.get_object(Bucket=BUCKET, Key=KEY)  # headers arrive at once
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        response["Body"].read()
    assert time.monotonic() - started < 5


def test_stall_mid_body_streams_the_first_part_then_resumes(fault_proxy: FaultProxy, client: Any) -> None:
    stall_s = 3.0  # long beside a request's round trip on a loaded machine (0.8 s was not)
    fault_proxy.set_rules([Rule("stall", delay_s=stall_s, body_fraction=0.5)])
    started = time.monotonic()
    body = client.get_object(Bucket=BUCKET, Key=KEY)["Body"]
    first = body.read(len(DATA) // 2)
    first_s = time.monotonic() - started
    rest = body.read()
    total_s = time.monotonic() - started
    assert first + rest == DATA
    # The first half arrives while the stall holds the second back: the body is streamed, not buffered.
    assert first_s < stall_s <= total_s, (first_s, total_s)


def test_latency_delays_the_answer(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("latency", delay_s=0.3, method="HEAD")])
    started = time.monotonic()
    client.head_object(Bucket=BUCKET, Key=KEY)
    assert time.monotonic() - started >= 0.3
    assert fault_proxy.counts().faults == {"latency": 1}


def test_corrupt_keeps_the_length_and_flips_bytes(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("corrupt", flip_bytes=3)])
    trusting = fault_proxy.client(response_checksum_validation="when_required")
    body = trusting.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    assert len(body) == len(DATA)
    differing = [index for index, (a, b) in enumerate(zip(body, DATA, strict=True)) if a != b]
    middle = len(DATA) // 2
    assert differing == [middle, middle + 1, middle + 2]
    # botocore's own response checksum (moto sends one) catches it.
    with pytest.raises(botocore.exceptions.FlexibleChecksumError):
        client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()


def test_replace_midway_swaps_the_object_while_the_body_streams(
    s3: LocalS3, fault_proxy: FaultProxy, client: Any
) -> None:
    old_etag = client.head_object(Bucket=BUCKET, Key=KEY)["ETag"]
    seen: list[RequestInfo] = []

    def replace(info: RequestInfo) -> None:
        seen.append(info)
        s3.client().put_object(Bucket=info.bucket, Key=info.key, Body=b"replaced")

    fault_proxy.set_rules([Rule("replace_midway", callback=replace, max_count=1)])
    assert client.get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == DATA  # one GET, one version
    assert [(info.op, info.key) for info in seen] == [("GetObject", KEY)]
    assert client.head_object(Bucket=BUCKET, Key=KEY)["ETag"] != old_etag
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.get_object(Bucket=BUCKET, Key=KEY, Range="bytes=0-9", IfMatch=old_etag)
    assert client_error(exc_info) == (412, "PreconditionFailed")


# ------------------------------------------------------------------------------------------ rules


def test_rules_match_on_method_key_regex_op_and_first_match_wins(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules(
        [
            Rule("status", status=404, method="GET", key="object 1"),
            Rule("status", status=403, key_regex=r"-2\.bin$", op="HeadObject"),
            Rule("slowdown", op="ListObjectsV2", query="list-type=2"),
            Rule("error500"),  # everything else
        ]
    )
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.get_object(Bucket=BUCKET, Key=KEY)
    assert client_error(exc_info) == (404, "NoSuchKey")
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.head_object(Bucket=BUCKET, Key=OTHER)
    assert client_error(exc_info) == (403, "403")
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.list_objects_v2(Bucket=BUCKET)
    assert client_error(exc_info) == (503, "SlowDown")
    with pytest.raises(botocore.exceptions.ClientError) as exc_info:
        client.get_object(Bucket=BUCKET, Key=OTHER)
    assert client_error(exc_info) == (500, "InternalError")
    assert fault_proxy.counts().faults == {"status": 2, "slowdown": 1, "error500": 1}
    fault_proxy.clear()
    assert client.get_object(Bucket=BUCKET, Key=OTHER)["Body"].read() == b"other"


def test_probability_is_seeded_and_counted(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("slowdown", probability=0.5), Rule("latency", delay_s=0.0)])
    failures = 0
    for _ in range(40):
        try:
            client.head_object(Bucket=BUCKET, Key=OTHER)
        except botocore.exceptions.ClientError:
            failures += 1
    counts = fault_proxy.counts()
    assert 5 < failures < 35
    assert counts.faults == {"slowdown": failures, "latency": 40 - failures}  # losers fall through
    assert counts.request("HEAD", OTHER) == 40


def test_rule_validation() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        Rule("explode")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="probability"):
        Rule("slowdown", probability=1.5)
    with pytest.raises(ValueError, match="status"):
        Rule("status")
    with pytest.raises(ValueError, match="body_fraction"):
        Rule("truncate", body_fraction=2.0)


# ------------------------------------------------------------------------------------------ other clients


def test_s3fs_through_the_proxy(fault_proxy: FaultProxy, client: Any) -> None:
    fs = s3fs.S3FileSystem(**fault_proxy.storage_options(), skip_instance_cache=True, use_listings_cache=False)
    assert fs.ls(f"{BUCKET}/dir") == [f"{BUCKET}/{KEY}", f"{BUCKET}/{OTHER}"]
    assert fault_proxy.counts().ops == {"ListObjectsV2": 1}
    fault_proxy.set_rules([Rule("slowdown", op="GetObject", max_count=1)])
    assert fs.cat(f"{BUCKET}/{OTHER}") == b"other"  # s3fs (or its botocore) retried the 503
    assert fault_proxy.counts().request("GET", OTHER) == 2
    fault_proxy.set_rules([Rule("status", status=404, op="GetObject")])
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{BUCKET}/{OTHER}")


def test_another_process_goes_through_the_proxy(fault_proxy: FaultProxy, client: Any) -> None:
    fault_proxy.set_rules([Rule("slowdown", key="object-2")])
    child = (
        "import sys, urllib.error, urllib.request\n"
        "try:\n"
        "    urllib.request.urlopen(sys.argv[1], timeout=10)\n"
        "except urllib.error.HTTPError as exc:\n"
        "    print(exc.code, exc.read().decode())\n"
    )
    url = f"{fault_proxy.endpoint}/{BUCKET}/{OTHER}"
    result = subprocess.run([sys.executable, "-c", child, url], capture_output=True, text=True, timeout=30)
    assert result.stdout.startswith("503 ") and "<Code>SlowDown</Code>" in result.stdout, result.stderr
    assert fault_proxy.counts().request("GET", OTHER) == 1


def test_stop_ends_a_stall_at_once(s3: LocalS3, client: Any) -> None:
    proxy = FaultProxy(s3.endpoint).start()
    proxy.set_rules([Rule("stall", delay_s=60)])
    result: list[bytes] = []
    reader = threading.Thread(
        target=lambda: result.append(proxy.client().get_object(Bucket=BUCKET, Key=OTHER)["Body"].read())
    )
    reader.start()
    deadline = time.monotonic() + 10
    while proxy.counts().fault("stall") == 0:
        assert time.monotonic() < deadline, "the request never reached the proxy"
        time.sleep(0.01)
    started = time.monotonic()
    proxy.stop()
    reader.join(timeout=10)
    assert time.monotonic() - started < 3
    assert not reader.is_alive()
    assert result == [b"other"]


# ------------------------------------------------------------------------------------------ tmpfs


@pytest.mark.root
def test_small_tmpfs_fills_up_with_enospc() -> None:
    size = 256 * 1024
    with small_tmpfs(size) as root:
        assert os.statvfs(root).f_blocks * os.statvfs(root).f_frsize == size
        written = 0
        fd = os.open(root / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError) as exc_info:
                while True:
                    written += os.write(fd, b"x" * 4096)
        finally:
            os.close(fd)
        assert exc_info.value.errno == errno.ENOSPC
        assert size - 4096 <= written <= size
    assert not root.exists()


@pytest.mark.root
def test_small_tmpfs_runs_out_of_inodes() -> None:
    with small_tmpfs(1024 * 1024, nr_inodes=16) as root:
        assert os.statvfs(root).f_files == 16
        created = 0
        with pytest.raises(OSError) as exc_info:
            while True:
                (root / f"f{created}").touch()
                created += 1
        assert exc_info.value.errno == errno.ENOSPC
        assert created == 15  # the root directory holds the 16th inode
        assert os.statvfs(root).f_bfree > 0  # space left: it is the inodes that ran out
    assert not root.exists()


@pytest.mark.root
def test_small_tmpfs_mount_is_visible_to_subprocesses(tmp_path: Path) -> None:
    with small_tmpfs(64 * 1024) as root:
        subprocess.run(["sh", "-c", f"echo hi > '{root}/from-child'"], check=True)
        assert (root / "from-child").read_text() == "hi\n"
        mounts = Path("/proc/self/mounts").read_text()
        assert f" {root} tmpfs " in mounts
