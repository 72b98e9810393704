"""One object whose decoding kills the sampler (a native decoder's segfault, a sample that exhausts memory): it was
handed out again first after every restart, so the daemon restarted its samplers forever and cached nothing
more, and nothing named the object. Now an object a sampler died writing twice is quarantined (kind ``crash``),
named in the log and in status; the rest is cached. One whose decoding hangs was worse: the sampler's heartbeat
comes from its event loop, so nothing noticed at all. Now status names it after ``status.stuck_after``, and the
sampler is killed at twice that, a death like a crash's. The witness is what the training loop receives."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachefeed._config import toml_text
from cachefeed._testing.daemon import start_daemon
from cachefeed._testing.samples import npy_bytes
from cachefeed._trainer import EpochLoaderFactory
from tests.support.child_env import child_env

OBJECTS = 12
POISON = "005.npy"


def crash_on_poison(sample: dict[str, Any]) -> dict[str, Any]:
    """``sampler.preprocess``: a real segfault (a read of address 0) on one object, as a crashing native decoder's."""
    if sample["__key__"].removesuffix(".npy") == POISON.removesuffix(".npy"):
        ctypes.string_at(0)
    return sample


def hang_on_poison(sample: dict[str, Any]) -> dict[str, Any]:
    """``sampler.preprocess``: never returns on one object, as a decoder stuck in a loop or on a lock."""
    if sample["__key__"].removesuffix(".npy") == POISON.removesuffix(".npy"):
        time.sleep(3600)
    return sample


@pytest.mark.parametrize("preprocess", ["crash_on_poison", "hang_on_poison"])
def test_an_object_that_kills_or_hangs_its_sampler_is_quarantined_and_the_rest_is_cached(
    tmp_path: Path, preprocess: str
) -> None:
    remote = tmp_path / "remote"
    remote.mkdir()
    for i in range(OBJECTS):
        (remote / f"{i:03d}.npy").write_bytes(npy_bytes(np.full(16, i, np.int32)))
    cache_dir = tmp_path / "cache"
    config = tmp_path / "crash.toml"
    config.write_text(
        toml_text(
            {
                "remote": {"url": remote.as_uri(), "refresh_interval": "1h"},
                "cache": {"dir": str(cache_dir), "max_bytes": "64MiB", "segment_bytes": "64KiB", "fsync": False},
                "sampler": {
                    "processes": 1,
                    "concurrency": 2,
                    "decode": "npy",
                    "preprocess": f"tests.daemon.test_crashing_object:{preprocess}",
                    "restart_backoff": "100ms",
                    "restart_backoff_max": "200ms",
                },
                "status": {"interval": "200ms", "stuck_after": "2s"},
            }
        )
    )
    daemon = start_daemon(config, cache_dir, tmp_path / "daemon.err", env=child_env())
    try:
        if preprocess == "hang_on_poison":
            hung = daemon.wait_status(
                lambda d: any("has been writing" in reason for reason in d["degraded_reasons"]),
                timeout_s=30,
                what="the hang named in status",
            )
            assert f"has been writing {(remote / POISON).as_uri()} for" in " ".join(hung["degraded_reasons"])
        doc = daemon.wait_status(
            lambda d: d["cache"]["samples"] == OBJECTS - 1 and d["remote"]["not_cached"].get("crash") == 1,
            timeout_s=60,
            what="every other object cached, the crashing one quarantined",
        )
        (entry,) = [e for e in doc["quarantined"] if e["kind"] == "crash"]
        assert entry["url"] == (remote / POISON).as_uri(), entry
        with EpochLoaderFactory(cache_dir, batch_size=1, run_id="crash", progress=None) as factory:
            served = sorted(int(batch["data"][0][0]) for batch in factory.loader(0))
    finally:
        daemon.stop()
    assert served == [i for i in range(OBJECTS) if i != 5], "each other object's sample, once"
    assert f"quarantined {(remote / POISON).as_uri()}: a sampler died writing it 2 times" in daemon.stderr()
