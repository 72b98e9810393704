"""Log hygiene: one line per event, credentials redacted (values and patterns, tracebacks included), chatty
third-party loggers capped, and a real botocore run at DEBUG that leaks nothing."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed._logs import (
    CHATTY_LOGGERS,
    RedactingFilter,
    RepeatedWarnings,
    add_secrets,
    redact,
    setup_logging,
)
from cachefeed._scrub import secrets_from_env, secrets_from_options
from cachefeed._testing.local_s3 import LocalS3
from tests.support.child_env import REPO, child_env


def sentinel(tag: str) -> str:
    return f"SENTINEL{tag}{uuid.uuid4().hex}"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """setup_logging changes process-wide state: put the root logger and the capped loggers back."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    hooks = sys.excepthook, threading.excepthook
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)
    sys.excepthook, threading.excepthook = hooks
    logging.captureWarnings(False)


def test_known_patterns_are_redacted() -> None:
    key_id = "AKIAIOSFODNN7EXAMPLE"
    cases = [
        ("Authorization: AWS4-HMAC-SHA256 Credential=X/2024/us-east-1/s3/aws4_request, Signature=abc", "abc"),
        ("{'Authorization': b'AWS4-HMAC-SHA256 Credential=X/2024, SignedHeaders=host, Signature=d34db33f'}", "d34db"),
        ("GET /b/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=Z%2F2024&X-Amz-Signature=f00dfeed&x=1", "f00dfeed"),
        ("GET /b/k?X-Amz-Credential=ZZCRED%2F2024&x=1", "ZZCRED"),
        ("{'X-Amz-Security-Token': b'FQoGZXIvYXdzEXAMPLETOKEN', 'Host': 'h'}", "FQoGZXIvYXdzEXAMPLETOKEN"),
        ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI"),
        ("{'key': 'public', 'secret': 'hunter2hunter2', 'token': 'tok3n-value'}", "hunter2"),
        ("{'key': 'public', 'secret': 'hunter2hunter2', 'token': 'tok3n-value'}", "tok3n"),
        ('{"password": "pa55word!"}', "pa55word"),
        (f"using access key {key_id} for s3", key_id),
    ]
    for text, secret in cases:
        assert secret in text
        shown = redact(text)
        assert secret not in shown, (text, shown)
        assert "***" in shown
    # ordinary text survives
    for text in ("fetched s3://bucket/key=1/part-0001.npy in 3 attempts", "retry budget: 5 tokens left"):
        assert redact(text) == text


def test_secret_values_from_options_and_env() -> None:
    key, secret = sentinel("KEY"), sentinel("SECRET")
    options = {"endpoint_url": "http://x", "key": key, "client_kwargs": {"aws_session_token": "nested-" + secret}}
    assert set(secrets_from_options(options)) == {key, "nested-" + secret}
    env = {"AWS_ACCESS_KEY_ID": "abcd", "MY_API_TOKEN": "longer-than-8", "HF_TOKEN_FLAG": "true", "PATH": "/bin"}
    assert set(secrets_from_env(env)) == {"abcd", "longer-than-8"}
    add_secrets(secrets_from_options(options))
    assert redact(f"url with {key} and nested-{secret}!") == "url with *** and ***!"


def test_filter_redacts_args_tracebacks_and_stacks_on_one_line(restore_logging: None) -> None:
    secret = sentinel("ARG")
    in_exception = sentinel("EXC")
    stream = io.StringIO()
    setup_logging("debug", secrets=[secret, in_exception], stream=stream, env={})
    log = logging.getLogger("cachefeed.test")
    log.info("connecting with %s and a\nsecond line \x1b[31m", secret)
    try:
        raise RuntimeError(f"boom {in_exception}\nAuthorization: AWS4-HMAC-SHA256 Signature=zz")
    except RuntimeError:
        log.exception("fetch failed")
    log.warning("stack", stack_info=True, extra={"note": secret})
    logging.getLogger("some.library").error("propagated from elsewhere: %r", {"secret": secret})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4
    text = stream.getvalue()
    assert secret not in text and in_exception not in text and "Signature=zz" not in text
    assert "Traceback (most recent call last):" in lines[1] and "RuntimeError: boom ***" in lines[1]
    assert "\\n" in lines[0] and "\x1b" not in text and "\\x1b[31m" in lines[0]
    assert f"INFO cachefeed.test[{os.getpid()}]: connecting with ***" in lines[0]
    assert "ERROR some.library" in lines[3] and "***" in lines[3]


def test_filter_on_any_handler_sees_exc_info_once() -> None:
    secret = sentinel("H")
    add_secrets([secret])
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", (secret,), None)
    try:
        raise ValueError(secret)
    except ValueError:
        record.exc_info = sys.exc_info()
    assert RedactingFilter().filter(record)
    formatted = logging.Formatter().format(record)
    assert secret not in formatted and "ValueError: ***" in formatted
    assert record.args == () and record.exc_info is None
    # a bad format string neither raises nor loses the event
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%d objects from %s", ("many", secret), None)
    assert RedactingFilter().filter(record)
    assert "many" in record.getMessage() and secret not in record.getMessage()


_UNCAUGHT = """
import sys, threading
from cachefeed._logs import setup_logging
setup_logging("info", secrets=[sys.argv[1]])
thread = threading.Thread(target=lambda: 1 / 0 if sys.argv[1] else None, name="fetcher")
thread.start()
thread.join()
raise RuntimeError("could not connect with " + sys.argv[1] + "\\nsecond line")
"""


def test_uncaught_exceptions_are_logged_redacted() -> None:
    secret = sentinel("UNCAUGHT")
    result = subprocess.run(
        [sys.executable, "-c", _UNCAUGHT, secret], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert "CRITICAL cachefeed.uncaught" in lines[0] and "in thread fetcher" in lines[0]
    assert "ZeroDivisionError" in lines[0]
    assert "RuntimeError: could not connect with ***" in lines[1]
    assert secret not in result.stderr


def test_journald_stream_gets_syslog_priorities(tmp_path: Path, restore_logging: None) -> None:
    with open(tmp_path / "journal", "w") as stream:
        info = os.fstat(stream.fileno())
        setup_logging("info", stream=stream, env={"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"})
        logging.getLogger("cachefeed.x").error("bad")
        logging.getLogger("cachefeed.x").info("fine")
        logging.getLogger("cachefeed.x").debug("hidden")
    lines = (tmp_path / "journal").read_text().splitlines()
    assert lines == [f"<3>ERROR cachefeed.x[{os.getpid()}]: bad", f"<6>INFO cachefeed.x[{os.getpid()}]: fine"]


def test_chatty_loggers_are_capped_even_at_debug(restore_logging: None) -> None:
    setup_logging("debug", stream=io.StringIO(), env={})
    assert logging.getLogger().level == logging.DEBUG
    for name in CHATTY_LOGGERS:
        assert logging.getLogger(name).getEffectiveLevel() == logging.WARNING, name
    assert logging.getLogger("botocore.endpoint").getEffectiveLevel() == logging.WARNING
    setup_logging("error", stream=io.StringIO(), env={})
    assert logging.getLogger("botocore").getEffectiveLevel() == logging.ERROR
    assert len([h for h in logging.getLogger().handlers if h.get_name() == "cachefeed"]) == 1
    with pytest.raises(ValueError, match="log level"):
        setup_logging("loud")


_BOTOCORE_RUN = """
import logging, sys
if sys.argv[1] == "cachefeed":
    from cachefeed._logs import setup_logging
    setup_logging("debug", secrets=[sys.argv[3]])
else:
    logging.basicConfig(level=logging.DEBUG)
import boto3, botocore.exceptions
client = boto3.client("s3", endpoint_url=sys.argv[2], region_name="us-east-1")
try:
    client.list_objects_v2(Bucket="no-such-bucket")
except botocore.exceptions.ClientError as exc:
    logging.getLogger("cachefeed.test").error("listing failed: %s", exc, exc_info=True)
"""


def test_real_botocore_debug_run_leaks_nothing(s3: LocalS3) -> None:
    """botocore at DEBUG prints the signed Authorization header and the session token: capped, nothing leaks.

    The control run (plain ``basicConfig``) shows that the same run does print them, so the test can fail.
    """
    key_id, secret, token = sentinel("AKID"), sentinel("SECRET"), sentinel("TOKEN")
    env = child_env(AWS_ACCESS_KEY_ID=key_id, AWS_SECRET_ACCESS_KEY=secret, AWS_SESSION_TOKEN=token)
    runs = {}
    for mode in ("plain", "cachefeed"):
        result = subprocess.run(
            [sys.executable, "-c", _BOTOCORE_RUN, mode, s3.endpoint, secret],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        runs[mode] = result.stderr
    assert key_id in runs["plain"] and token in runs["plain"]  # the leak being guarded against
    assert "listing failed" in runs["cachefeed"] and "NoSuchBucket" in runs["cachefeed"]
    for value in (key_id, secret, token):
        assert value not in runs["cachefeed"]
    assert all(line.count("cachefeed.test[") <= 1 for line in runs["cachefeed"].splitlines())


def test_one_scrubber_for_urls_in_logs_status_and_errors() -> None:
    """The daemon's logs, its status document and the remote's error messages share one URL scrubber."""
    from cachefeed._scrub import safe_url

    assert safe_url("s3://AKIDEXAMPLE:s3cr3t@bucket/prefix") == "s3://***@bucket/prefix"
    assert safe_url("https://user:pw@host:9000/a/b") == "https://***@host:9000/a/b"
    assert safe_url("file:///data") == "file:///data" and safe_url("no-scheme") == "no-scheme"


def test_the_remote_and_the_logs_scrub_the_same_url_and_options_alike(restore_logging: None) -> None:
    """One scrubber: a remote error and a log line saying the same thing, given the same storage_options, read the
    same (values, a value inside a longer one, and patterns such as ``token=`` alike)."""
    import fsspec

    from cachefeed._config import RemoteConfig
    from cachefeed._errors import ConfigError
    from cachefeed._remote import Remote
    from cachefeed._scrub import safe_url

    key, secret = sentinel("KEY"), sentinel("SECRET")
    options = {"key": key, "secret": secret, "client_kwargs": {"aws_session_token": f"{secret}-token"}}
    url = f"nosuchproto://user:{secret}@host/{key}/{secret}-token/run/token=t0k3nvalue/x.npy"
    with pytest.raises(ValueError) as backend:
        fsspec.get_filesystem_class("nosuchproto")
    with pytest.raises(ConfigError) as caught:
        Remote(RemoteConfig(url=url, storage_options=options))

    stream = io.StringIO()
    setup_logging("info", secrets=secrets_from_options(options), stream=stream, env={})
    logging.getLogger("cachefeed.test").error("remote.url = %r: %s", safe_url(url), backend.value)
    logged = stream.getvalue().rstrip("\n").split("]: ", 1)[1]

    assert str(caught.value) == logged
    assert logged.startswith("remote.url = 'nosuchproto://***@host/***/***/run/token=***'")
    for value in (key, secret, "t0k3nvalue"):
        assert value not in logged


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_warning_that_repeats_per_object_is_logged_a_few_times_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    logger, clock = logging.getLogger("cachefeed.test.repeated"), _Clock()
    repeated = RepeatedWarnings(logger, first=3, every_s=60.0, clock=clock)
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for i in range(10):
            repeated.warn("decode", "object quarantined (decode) s3://b/%d: not an npy file", i)
            clock.now += 1.0
        repeated.warn("too_large", "object quarantined (too_large) s3://b/big")  # another kind: its own first ones
        clock.now += 60.0
        repeated.warn("decode", "object quarantined (decode) s3://b/%d: not an npy file", 10)  # due: the summary
        repeated.warn("decode", "object quarantined (decode) s3://b/%d: not an npy file", 11)
        repeated.flush()  # the owner's exit: nothing held back is left unsaid
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[:4] == [
        "object quarantined (decode) s3://b/0: not an npy file",
        "object quarantined (decode) s3://b/1: not an npy file",
        "object quarantined (decode) s3://b/2: not an npy file",
        "further 'decode' warnings are counted, not logged one by one (each at debug level): a count every 60s",
    ]
    assert warnings[4] == "object quarantined (too_large) s3://b/big"
    assert (
        warnings[5]
        == "8 more 'decode' warnings in 67s, the last: object quarantined (decode) s3://b/10: not an npy file"
    )
    assert (
        warnings[6]
        == "1 more 'decode' warnings in 0s, the last: object quarantined (decode) s3://b/11: not an npy file"
    )
    assert len(warnings) == 7
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 9  # each one held back is still in the log at debug level
