"""Rank detection, run ids, and each rank's share of an epoch: disjoint, equal, deterministic."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachefeed._cache.layout import SNAPSHOT_ID
from cachefeed._trainer.partition import (
    EpochBatchSampler,
    RankInfo,
    default_run_id,
    detect_ranks,
    epoch_order,
    epoch_share,
    launcher_run_id,
    sanitize_run_id,
)


@given(samples=st.integers(0, 5000), world=st.integers(1, 9), epoch=st.integers(0, 1000), seed=st.integers(0, 99))
def test_shares_are_disjoint_equal_and_cover_all_but_the_remainder(samples: int, world: int, epoch: int, seed: int):
    per_rank = samples // world
    shares = [
        epoch_share(
            samples, seed=seed, epoch=epoch, shuffle=True, local_rank=r, local_world_size=world, per_rank=per_rank
        )
        for r in range(world)
    ]
    assert all(len(share) == per_rank for share in shares)
    union = np.concatenate(shares) if shares else np.empty(0)
    assert len(np.unique(union)) == len(union) == per_rank * world, "no index twice across ranks"
    assert samples - len(union) < world, "only the remainder is dropped"
    assert union.size == 0 or (union.min() >= 0 and union.max() < samples)


def test_the_order_is_deterministic_per_seed_and_epoch_and_changes_between_epochs() -> None:
    first = epoch_order(1000, seed=3, epoch=1, shuffle=True)
    assert np.array_equal(first, epoch_order(1000, seed=3, epoch=1, shuffle=True))
    assert not np.array_equal(first, epoch_order(1000, seed=3, epoch=2, shuffle=True))
    assert not np.array_equal(first, epoch_order(1000, seed=4, epoch=1, shuffle=True))
    assert np.array_equal(epoch_order(10, seed=3, epoch=1, shuffle=False), np.arange(10))
    assert first.dtype == np.int64


@pytest.mark.parametrize(
    ("count", "batch", "drop_last", "expected"),
    [(10, 3, False, 4), (10, 3, True, 3), (9, 3, False, 3), (0, 4, False, 0)],
)
def test_the_batch_sampler_cuts_arrays(count: int, batch: int, drop_last: bool, expected: int) -> None:
    sampler = EpochBatchSampler(np.arange(count, dtype=np.int64), batch, drop_last=drop_last)
    batches = list(sampler)
    assert len(batches) == len(sampler) == expected
    assert all(isinstance(b, np.ndarray) for b in batches)
    flat = np.concatenate(batches) if batches else np.empty(0)
    assert list(flat) == list(range(len(flat)))
    with pytest.raises(ValueError):
        EpochBatchSampler(np.arange(3), 0)


def test_explicit_ranks_name_the_ranks_sharing_the_cache() -> None:
    info = detect_ranks(1, 3, env={})
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 3, 1, 3)
    assert not info.is_creator and not info.nodes_differ
    with pytest.raises(ValueError, match="both"):
        detect_ranks(1, None, env={})
    with pytest.raises(ValueError):
        detect_ranks(3, 3, env={})


def test_torchrun_environment_is_read_when_torch_distributed_is_not_initialised() -> None:
    assert detect_ranks(env={}) == RankInfo()
    info = detect_ranks(env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (info.rank, info.local_rank, info.local_world_size) == (1, 1, 2)
    with pytest.raises(ValueError, match=r"initialise torch\.distributed"):
        detect_ranks(env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})


def test_run_ids_come_from_the_launcher_and_are_valid_snapshot_names() -> None:
    assert launcher_run_id({"TORCHELASTIC_RUN_ID": "abc-123"}) == "abc-123"
    assert launcher_run_id({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}) == "10.0.0.1-29500"
    assert launcher_run_id({}) is None
    assert default_run_id({}).startswith("pid")
    for raw in ["a/b c", "..x", "::1", "é" * 300, "-lead"]:
        name = sanitize_run_id(raw)
        assert SNAPSHOT_ID.match(f"{name}-e000001"), (raw, name)


def test_a_topped_up_growing_share_gives_every_local_rank_its_quota_disjoint_the_unread_first() -> None:
    from cachefeed._trainer.growing import GrowingShare

    counts = (7, 6, 5, 8, 8)  # generations: unread (0, 1), unread (2); the top-up: read segments 3 and 4
    generations = (2, 3, 5)
    reads = np.array([0] * 18 + [1] * 8 + [2] * 8, dtype=np.int64)
    shares = []
    for rank in range(2):
        share = GrowingShare(seed=3, epoch=1, shuffle=True, local_rank=rank, local_world_size=2, quota=12)
        share.update(counts[:3], generations[:2], True, lambda a, b: reads[sum(counts[:a]) : sum(counts[:b])])
        assert not share.is_complete
        share.update(counts, generations, False, lambda a, b: reads[sum(counts[:a]) : sum(counts[:b])], 2)
        assert share.is_complete and len(share.indices) == 12
        shares.append(share.indices)
    both = np.concatenate(shares)
    assert len(set(both.tolist())) == 24, "disjoint, each sample once"
    assert set(range(18)) <= set(both.tolist()), "every unread sample first (the carry included)"
    assert set(both.tolist()) - set(range(18)) <= set(range(18, 26)), "then the least-read"


def test_a_growing_share_that_closes_short_of_its_quota_reuses_samples_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachefeed._trainer import partition
    from cachefeed._trainer.growing import GrowingShare

    monkeypatch.setattr(partition, "_reuse_warned", False)  # once per process: another test may have said it
    share = GrowingShare(seed=1, epoch=4, shuffle=True, local_rank=0, local_world_size=1, quota=20)
    with caplog.at_level(logging.WARNING):
        share.update((8,), (1,), False)  # closed with 8 samples, no top-up: the whole cache held fewer
    assert share.is_complete and len(share.indices) == 20 and set(share.indices.tolist()) == set(range(8))
    assert any("epoch 4 has 8 samples for its 20" in r.getMessage() for r in caplog.records)
