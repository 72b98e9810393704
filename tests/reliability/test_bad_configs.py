"""Invalid configs through the real CLI: ``cachefeed daemon --config bad.toml`` exits 78 (EX_CONFIG, so systemd
does not restart it) with exactly one line on stderr, no traceback, and creates no cache directory.

Each case is a real subprocess; they run a few at a time.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cachefeed._config import toml_text
from cachefeed._testing.daemon import daemon_argv
from tests.reliability.common import report

GOOD: dict[str, dict[str, Any]] = {
    "remote": {"url": "s3://data/train/", "storage_options": {"endpoint_url": "http://127.0.0.1:9"}},
    "cache": {"dir": "CACHE", "max_bytes": "64MiB", "segment_bytes": "1MiB", "min_free_bytes": 0},
}


def variant(section: str, key: str, value: Any = None, *, drop: bool = False) -> str:
    document = {name: dict(body) for name, body in GOOD.items()}
    body = document.setdefault(section, {})
    if drop:
        body.pop(key)
    else:
        body[key] = value
    return toml_text(document)


# name -> (config text, or bytes, or None for "no such file"; extra environment; what the line must name)
CASES: dict[str, tuple[str | bytes | None, dict[str, str], str]] = {
    "missing-file": (None, {}, "no such config file"),
    "empty-file": ("", {}, "is required"),
    "not-toml": ("[remote\nurl = 's3://x'\n", {}, "not valid TOML"),
    "not-utf8": (b'[remote]\nurl = "s3://\xff\xfe"\n', {}, "UTF-8"),
    "unknown-section": (toml_text({**GOOD, "cahce": {"dir": "/x"}}), {}, "cahce"),
    "unknown-key": (variant("cache", "max_byte", "1GiB"), {}, "cache.max_byte"),
    "missing-dir": (variant("cache", "dir", drop=True), {}, "cache.dir"),
    "negative-size": (variant("cache", "max_bytes", "-5GiB"), {}, "cache.max_bytes"),
    "size-word": (variant("cache", "max_bytes", "lots"), {}, "cache.max_bytes"),
    "bad-duration": (variant("remote", "refresh_interval", "5 parsecs"), {}, "remote.refresh_interval"),
    "bad-enum": (variant("cache", "eviction", "lru"), {}, "cache.eviction"),
    "int-for-bool": (variant("cache", "fsync", 1), {}, "cache.fsync"),
    "bool-for-int": (variant("sampler", "concurrency", True), {}, "sampler.concurrency"),
    "nan": (
        "[remote]\nurl = 's3://d/'\nread_timeout = nan\n[cache]\ndir = 'CACHE'\nmax_bytes = '64MiB'\n",
        {},
        "remote.read_timeout",
    ),
    "relative-dir": (variant("cache", "dir", "relative/cache"), {}, "cache.dir"),
    "dotdot-dir": (variant("cache", "dir", "/tmp/../etc/cache"), {}, "cache.dir"),
    "empty-url": (variant("remote", "url", ""), {}, "remote.url"),
    "url-newline": (variant("remote", "url", "s3://data/\nx"), {}, "remote.url"),
    "port-range": (variant("status", "metrics_port", 70000), {}, "status.metrics_port"),
    "below-floor": (variant("cache", "max_bytes", "2MiB"), {}, "cache.max_bytes"),
    "turnover-too-big": (variant("cache", "turnover", "99%"), {}, "cache.turnover"),
    "backoff-inverted": (
        toml_text({**GOOD, "remote": {**GOOD["remote"], "backoff_base": "10s", "backoff_max": "1s"}}),
        {},
        "remote.backoff_base",
    ),
    "rank-above-count": (toml_text({**GOOD, "node": {"rank": 3, "count": 2}}), {}, "node.rank"),
    "env-rank-garbage": (toml_text(GOOD), {"NODE_RANK": "abc"}, "NODE_RANK"),
    "preprocess-form": (variant("sampler", "preprocess", "nocolon"), {}, "sampler.preprocess"),
    "dir-mode": (variant("cache", "dir_mode", "0999"), {}, "cache.dir_mode"),
    "section-not-table": ('remote = 5\n[cache]\ndir = "/x"\nmax_bytes = "64MiB"\n', {}, "[remote]"),
    "zero-processes": (variant("sampler", "processes", 0), {}, "sampler.processes"),
    "budget-fraction": (variant("remote", "retry_budget", 1.5), {}, "remote.retry_budget"),
    "log-level": (variant("log", "level", "verbose"), {}, "log.level"),
    "compression": (variant("cache", "compression", "lz4"), {}, "cache.compression"),
    "size-lowercase-unit": (variant("cache", "max_bytes", "64mib"), {}, "did you mean 64MiB?"),
    "size-with-space": (variant("cache", "max_bytes", "64 MiB"), {}, "spelled exactly so"),
    "image-size-unread": (
        toml_text({**GOOD, "sampler": {"decode": "npz", "image_size": 224}}),
        {},
        "sampler.image_size = 224 is read only by the image decoders",
    ),
}
# Checked once the config parsed (importing the decoder, resolving the protocol), still before any log line.
RUNTIME_CASES: dict[str, tuple[str | bytes | None, dict[str, str], str]] = {
    "decoder-missing": (variant("sampler", "decode", "no_such_module_xyz:decode"), {}, "no_such_module_xyz"),
    "preprocess-missing": (variant("sampler", "preprocess", "no_such_module_xyz:fn"), {}, "no_such_module_xyz"),
    "unknown-protocol": (variant("remote", "url", "nosuchproto://bucket/x"), {}, "nosuchproto"),
}


def run_case(tmp_path: Path, name: str) -> tuple[str, subprocess.CompletedProcess[str], Path]:
    text, env, _ = {**CASES, **RUNTIME_CASES}[name]
    cache_dir = tmp_path / f"cache-{name}"
    path = tmp_path / f"{name}.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text.replace("CACHE", str(cache_dir)))
    result = subprocess.run(
        daemon_argv(path), capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **env}
    )
    return name, result, cache_dir


def check_cases(tmp_path: Path, cases: dict[str, tuple[Any, dict[str, str], str]], scenario: str) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda name: run_case(tmp_path, name), cases))
    problems = {}
    for name, result, cache_dir in results:
        lines = result.stderr.strip().splitlines()
        named = cases[name][2]
        if result.returncode != 78:
            problems[name] = f"exit {result.returncode}: {result.stderr[-500:]}"
        elif len(lines) != 1 or "Traceback" in result.stderr:
            problems[name] = f"not one line: {result.stderr[-500:]}"
        elif named not in lines[0]:
            problems[name] = f"does not name {named!r}: {lines[0]}"
        elif cache_dir.exists():
            problems[name] = "created the cache directory"
        elif result.stdout:
            problems[name] = f"wrote to stdout: {result.stdout[:200]}"
    report(scenario, configs=len(cases), exit_78_one_line=len(cases) - len(problems), violations=len(problems))
    assert not problems, problems


def test_invalid_configs_exit_78_with_one_line(tmp_path: Path) -> None:
    assert len(CASES) >= 20
    check_cases(tmp_path, CASES, "bad-configs")


def test_configs_invalid_only_at_run_time_exit_78_with_one_line(tmp_path: Path) -> None:
    check_cases(tmp_path, RUNTIME_CASES, "bad-configs-runtime")
