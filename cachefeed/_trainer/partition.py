"""Who reads what: ranks sharing a cache, the run id that names snapshots, and each rank's share of an epoch.

Ranks and nodes: every node has its own cache (its daemon fetches a disjoint part of the remote dataset), and the
ranks *on a node* share that node's snapshot. So an epoch's snapshot is split among the node's local ranks
(``local_rank`` of ``local_world_size``), never among all ranks of the job: with a global split, half of every
node's snapshot would be read by ranks of other nodes that do not have it. Across nodes, the snapshots differ in
size; DDP needs the same number of batches on every rank, so with more than one node the share is cut to the
smallest node's (an all-reduce MIN on a dedicated gloo group, see ``loader.py``).

Equal shares: each local rank gets ``samples // local_world_size`` samples from a permutation seeded by
``(seed, epoch)``; the remainder (fewer than ``local_world_size`` samples) is **dropped** for this epoch rather than
padded with repeats, so no sample is delivered twice in an epoch. The permutation differs each epoch, so a dropped
sample is not dropped the next time (and a cut pass, like the smallest node's share below, takes the least-read
samples first).

Epochs of a set size (``samples_per_epoch = N``, see ``fixed_size_order``): the node's epoch is exactly N samples
(N less its remainder by the local ranks, which equal shares drop as above: the factory warns) of its snapshot, the
least-read samples first (per-sample reads, NOTE [ Read receipts ] in ``_cache/reads.py``;
ties in a seeded random order), so epochs smaller than the cache still serve every cached sample in turn;
without replacement while the snapshot holds N or more; with fewer, every sample is used and the rest is filled by
further seeded passes over the snapshot (reuse), never the same sample twice in a row of passes. The N are then
shuffled and split equally among the local ranks (``N // local_world_size`` each), so ``len(loader)`` is known before
training starts and is the same on every node.

Weighted sources (``[[source]]`` tables, see ``weighted_order``): the node's epoch (N samples with
``samples_per_epoch``, else as many as the snapshot holds) is cut into one share per source, ``N x weight``
(largest remainders, so the shares add up to N exactly), each drawn from that source's samples as above: least-read
first, without replacement while the source has enough cached, reused in seeded passes when it has fewer than its
share (a small source is *upsampled*, as a weighted sampler does). A source with nothing in the snapshot gets no
share; the others split its weight. The shares are then shuffled together and split among the ranks as above.

Without replacement means the *cache*, not the snapshot (``source_shares``): a snapshot pins whole segments, each
source first its weight's share of the epoch room (``_cache/room.py``), so a source may be pinned a few samples
short of its share while it has more cached (MANIFEST ``left_out``: it had segments the snapshot did not pin), and
another a few samples beyond its own. Then the short source gives the samples it lacks to the sources with pinned
samples beyond their shares, by weight: it serves each of its pinned samples once, and no pinned sample is left
unserved for it. Only a source whose whole cache is pinned is upsampled, and only by its own weight: the repeats
that no source can spare pinned samples for (``samples_per_epoch`` above what the snapshot holds) stay with the
sources by weight, as before. So the shares follow the weights within about a segment's samples, not to the sample.
Shares come from the MANIFEST and N alone: every rank of the node computes the same ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.random  # numpy loads it on first use: here, not on the clock of the first batch
import numpy.typing as npt
import torch
from torch.utils.data import Sampler

from cachefeed._logs import get_logger

__all__ = [
    "EpochBatchSampler",
    "RankInfo",
    "default_run_id",
    "detect_ranks",
    "epoch_order",
    "epoch_share",
    "fixed_size_order",
    "job_id",
    "launcher_run_id",
    "rank_share",
    "sanitize_run_id",
    "snapshot_name",
    "source_shares",
    "warn_reuse",
    "weighted_order",
]

log = get_logger(__name__)
_reuse_warned = False  # ``warn_reuse`` has warned in this process

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True)
class RankInfo:
    """This process's place in the job.

    Attributes:
        rank, world_size: global (for messages and the cross-node agreement).
        local_rank, local_world_size: among the ranks that share this node's cache; the snapshot is split here.
        is_distributed: torch.distributed is initialised (cross-node agreement possible).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    is_distributed: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is not in [0, local_world_size={self.local_world_size})")
        if self.local_world_size > self.world_size:
            raise ValueError(f"local_world_size {self.local_world_size} exceeds world_size {self.world_size}")

    @property
    def is_creator(self) -> bool:
        """Local rank 0 creates each epoch's snapshot; the node's other ranks join it."""
        return self.local_rank == 0

    @property
    def nodes_differ(self) -> bool:
        """More than one cache takes part: shares must be agreed across nodes."""
        return self.world_size > self.local_world_size


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


def detect_ranks(
    rank: int | None = None, world_size: int | None = None, *, env: Mapping[str, str] | None = None
) -> RankInfo:
    """Work out ``RankInfo`` from explicit arguments, else torch.distributed, else torchrun's environment.

    Explicit ``rank``/``world_size`` name the ranks that share this cache (one node: local rank = rank).
    Otherwise, with torch.distributed initialised, the global rank and size come from it and the local ones from
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (set by torchrun; without them, one node is assumed). Without
    torch.distributed, torchrun's ``RANK``/``WORLD_SIZE`` are read, if set.
    """
    env = os.environ if env is None else env
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither (to detect them)")
    if rank is not None and world_size is not None:
        return RankInfo(rank, world_size, rank, world_size)
    is_dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if is_dist:
        g_rank, g_world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        g_rank, g_world = _env_int(env, "RANK") or 0, _env_int(env, "WORLD_SIZE") or 1
    local, local_world = _env_int(env, "LOCAL_RANK"), _env_int(env, "LOCAL_WORLD_SIZE")
    if local is None or local_world is None:
        local, local_world = g_rank, g_world  # no launcher variables: one node
    info = RankInfo(g_rank, g_world, local, local_world, is_dist)
    if info.nodes_differ and not is_dist:
        raise ValueError(
            f"WORLD_SIZE={g_world} spans more than one node (LOCAL_WORLD_SIZE={local_world}): initialise "
            "torch.distributed before creating the EpochLoaderFactory, so nodes can agree on epoch sizes"
        )
    return info


def launcher_run_id(env: Mapping[str, str] | None = None) -> str | None:
    """The run's name as the launcher gives it: torchrun's ``TORCHELASTIC_RUN_ID`` (unless it is torchrun's
    default ``none``), else the rendezvous address."""
    env = os.environ if env is None else env
    raw = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if raw == "none":  # torchrun without --rdzv-id: every job has it
        raw = ""
    if not raw and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        raw = f"{env['MASTER_ADDR']}-{env['MASTER_PORT']}"
    return sanitize_run_id(raw) if raw else None


def default_run_id(env: Mapping[str, str] | None = None) -> str:
    """A name shared by every rank of this run: ``launcher_run_id``, else the pid (one process only)."""
    return launcher_run_id(env) or f"pid{os.getpid()}"


def job_id(ranks: RankInfo, *, broadcast: Callable[[int], int] | None, env: Mapping[str, str] | None = None) -> str:
    """A name of this job that all its ranks on a node share and no other job has: part of every snapshot's name
    and MANIFEST (NOTE [ Snapshot pinning protocol ]), so two jobs never join each other's snapshots, whatever
    their run ids.

    * With torch.distributed (``broadcast`` sends global rank 0's value to every rank): a random number of rank 0.
    * One process sharing the cache: a random number.
    * Several local ranks that cannot talk (no torch.distributed): derived from what the launcher gives every rank
      of one job alike and no two live jobs on a node share: the rendezvous endpoint (``MASTER_ADDR``,
      ``MASTER_PORT``: a port two jobs cannot both hold), the run id and the restart count. Without a launcher, the
      explicit ``run_id`` must then differ between jobs (the only case where it must).
    """
    env = os.environ if env is None else env
    if broadcast is not None:
        return f"{broadcast(secrets.randbits(48)):012x}"
    if ranks.local_world_size == 1:
        return secrets.token_hex(6)
    parts = [env.get(name, "") for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")]
    parts.append(env.get("TORCHELASTIC_RESTART_COUNT", ""))
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=6).hexdigest()


def snapshot_name(run_id: str, job: str, epoch: int) -> str:
    """The snapshot of ``epoch`` for job ``job`` of run ``run_id`` (at most 122 characters: a valid id)."""
    return f"{run_id}-{job}-e{epoch:06d}"


def sanitize_run_id(raw: str) -> str:
    """Map any string to a valid snapshot-id prefix (letters, digits, ``_.-``; at most 100 characters)."""
    cleaned = _UNSAFE.sub("_", raw).strip("._-")[:100]
    return cleaned if cleaned and cleaned[0].isalnum() else f"r{cleaned}"


def epoch_order(samples: int, *, seed: int, epoch: int, shuffle: bool) -> npt.NDArray[np.int64]:
    """The epoch's sample order: a permutation seeded by ``(seed, epoch)``, identical in every process."""
    if not shuffle:
        return np.arange(samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(samples).astype(np.int64, copy=False)


def epoch_share(
    samples: int, *, seed: int, epoch: int, shuffle: bool, local_rank: int, local_world_size: int, per_rank: int
) -> npt.NDArray[np.int64]:
    """This rank's ``per_rank`` indices: a contiguous slice of the epoch order (disjoint across local ranks)."""
    if per_rank * local_world_size > samples:
        raise ValueError(f"{local_world_size} shares of {per_rank} do not fit in {samples} samples")
    order = epoch_order(samples, seed=seed, epoch=epoch, shuffle=shuffle)
    return order[local_rank * per_rank : (local_rank + 1) * per_rank]


def fixed_size_order(
    sample_reads: npt.NDArray[np.int64],
    n: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    stream: int = 0,
) -> npt.NDArray[np.int64]:
    """The node's ``n`` sample indices for one epoch of a set size (module docstring): least-read first, then
    reuse in seeded passes when the snapshot holds fewer than ``n``; shuffled by ``(seed, epoch)``.
    ``sample_reads``: each sample's reads (``Snapshot.sample_reads()``). ``stream`` varies the seeded draws (one
    stream per source)."""
    samples = len(sample_reads)
    if samples == 0:
        raise ValueError("the snapshot is empty: no epoch of a set size can be drawn from it")
    rng = np.random.default_rng([seed, epoch, 1, stream])
    tiebreak = rng.permutation(samples)
    chosen = np.lexsort((tiebreak, sample_reads))[: min(n, samples)].astype(np.int64)
    passes = [chosen]
    have = len(chosen)
    while have < n:  # fewer samples than the epoch: reuse, a seeded pass at a time
        extra = rng.permutation(samples)[: n - have].astype(np.int64)
        passes.append(extra)
        have += len(extra)
    order = np.concatenate(passes)
    if shuffle:
        order = order[np.random.default_rng([seed, epoch]).permutation(n)]
    return order


def source_shares(
    available: Mapping[int, int],
    weights: Mapping[int, float],
    n: int,
    left_out: Collection[int] | None = None,
) -> dict[int, int]:
    """How many of ``n`` samples each source (tag) gives: ``n x weight`` by largest remainders, over the sources
    that have samples (``available``); ties go to the lower tag. Sums to ``n`` (0 if no source has samples).

    ``left_out``: the sources with cached samples the snapshot did not pin (MANIFEST ``left_out``; None: not
    recorded, no change). Such a source's share above ``available`` (it would repeat samples while the cache holds
    others) moves to the sources whose share is below what they have pinned (they would leave pinned samples
    unserved), by weight, as far as those can take it without repeating. What no source can take stays where it
    was: samples are reused by weight, as without the record (``samples_per_epoch`` above what the snapshot holds;
    a small source pinned whole and upsampled never takes another's repeats)."""
    present = sorted(tag for tag in weights if available.get(tag, 0) > 0 and weights[tag] > 0)
    if not present or n <= 0:
        return {}
    shares = _by_weight(n, {tag: weights[tag] for tag in present})
    capped = frozenset(left_out or ())
    over = {tag: shares[tag] - available[tag] for tag in present if tag in capped and shares[tag] > available[tag]}
    spare = {tag: available[tag] - shares[tag] for tag in present if shares[tag] < available[tag]}
    moved = min(sum(over.values()), sum(spare.values()))
    if moved:
        given = _by_weight(moved, {tag: weights[tag] for tag in over}, limits=over)
        taken = _by_weight(moved, {tag: weights[tag] for tag in spare}, limits=spare)
        for tag in present:
            shares[tag] += taken.get(tag, 0) - given.get(tag, 0)
    return shares


def _by_weight(n: int, weights: Mapping[int, float], limits: Mapping[int, int] | None = None) -> dict[int, int]:
    """``n`` split over ``weights`` (positive) in proportion, by largest remainders (ties to the lower tag); with
    ``limits`` (adding up to ``n`` at least), none above its limit: a tag at its limit is held there and the rest
    split again over the others."""
    shares: dict[int, int] = {}
    open_tags, left = sorted(weights), n
    while open_tags:
        total = sum(weights[tag] for tag in open_tags)
        exact = {tag: left * weights[tag] / total for tag in open_tags}
        trial = {tag: int(exact[tag]) for tag in open_tags}
        by_remainder = sorted(open_tags, key=lambda tag: (-(exact[tag] - trial[tag]), tag))
        for tag in by_remainder[: left - sum(trial.values())]:
            trial[tag] += 1
        full = [tag for tag in open_tags if trial[tag] >= limits[tag]] if limits is not None else []
        if not full or limits is None:
            return shares | trial
        for tag in full:
            shares[tag] = limits[tag]
            left -= limits[tag]
        open_tags = [tag for tag in open_tags if tag not in full]
    return shares


def weighted_order(
    counts: Sequence[int],
    sample_reads: npt.NDArray[np.int64],
    tags: Sequence[int],
    weights: Mapping[int, float],
    n: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    left_out: Collection[int] | None = None,
) -> npt.NDArray[np.int64]:
    """The node's ``n`` sample indices for one epoch over weighted sources (module docstring): each source's
    share (``source_shares``; ``left_out``: the snapshot's sources with cached samples it did not pin) drawn as
    ``fixed_size_order`` draws, from that source's segments; shuffled together by ``(seed, epoch)``. Segments whose
    tag has no weight are not drawn."""
    counts_a = np.asarray(counts, dtype=np.int64)
    tags_a = np.asarray(tags, dtype=np.int64)
    starts = np.zeros(len(counts_a) + 1, dtype=np.int64)
    np.cumsum(counts_a, out=starts[1:])
    available = {tag: int(counts_a[tags_a == tag].sum()) for tag in weights}
    shares = source_shares(available, weights, n, left_out)
    if sum(shares.values()) < n:
        raise ValueError(f"no weighted source has samples in the snapshot: cannot draw {n}")
    parts = []
    for tag, share in sorted(shares.items()):
        segments = np.flatnonzero(tags_a == tag)
        members = np.concatenate([np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in segments])
        local = fixed_size_order(
            sample_reads[members],
            share,
            seed=seed,
            epoch=epoch,
            shuffle=False,
            stream=tag,
        )
        parts.append(members[local])
    order = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    if shuffle:
        order = order[np.random.default_rng([seed, epoch]).permutation(len(order))]
    return order


def rank_share(
    counts: Sequence[int],
    sample_reads: Callable[[], npt.NDArray[np.int64]],
    tags: Sequence[int],
    weights: Mapping[int, float],
    *,
    epoch: int,
    seed: int,
    shuffle: bool,
    ranks: RankInfo,
    samples_per_epoch: int | None,
    agree_min: Callable[[int], int],
    left_out: Collection[int] | None = None,
) -> npt.NDArray[np.int64]:
    """This rank's indices into a snapshot (its segments' ``counts`` and source ``tags``; ``sample_reads`` gives its
    per-sample reads, asked for only where an order needs them) for ``epoch``, by the rules of the module docstring:
    weighted over named sources (``weights`` by tag, empty without), of a set size (``samples_per_epoch``) or one pass
    (least-read first when the pass is cut to fewer samples than the snapshot holds: the smallest node's share, or the
    remainder of an uneven split). ``agree_min`` agrees a per-rank size across nodes (a MIN all-reduce; identity on one
    node). ``left_out``: the snapshot's sources with cached samples it did not pin (``Snapshot.left_out``), which
    repeat no samples while another source has pinned samples to spare (``source_shares``)."""
    local, world = ranks.local_rank, ranks.local_world_size
    samples = int(sum(counts))
    per_rank = samples_per_epoch // world if samples_per_epoch is not None else agree_min(samples // world)
    n = per_rank * world
    if weights:
        order = weighted_order(
            counts, sample_reads(), tags, weights, n, seed=seed, epoch=epoch, shuffle=shuffle, left_out=left_out
        )
    elif samples_per_epoch is not None or n < samples:
        order = fixed_size_order(sample_reads(), n, seed=seed, epoch=epoch, shuffle=shuffle)
    else:
        return epoch_share(
            samples,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            local_rank=local,
            local_world_size=world,
            per_rank=per_rank,
        )
    return order[local * per_rank : (local + 1) * per_rank]


class EpochBatchSampler(Sampler[npt.NDArray[np.int64]]):
    """Yields one rank's share in batches: int64 arrays, cut from a numpy array (no per-sample Python objects)."""

    def __init__(self, indices: npt.NDArray[np.int64], batch_size: int, *, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.indices = indices
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        full, rest = divmod(len(self.indices), self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def __iter__(self) -> Iterator[npt.NDArray[np.int64]]:
        size = self.batch_size
        for start in range(0, len(self) * size, size):
            yield self.indices[start : start + size]


def warn_reuse(epoch: int, have: int, want: int) -> None:
    """Say that an epoch of a set size serves some samples twice: it has ``have`` samples for ``want`` (the node's,
    or a rank's share). A warning the first time in a process, then at debug level (every epoch of a small cache
    would repeat it)."""
    global _reuse_warned  # once per process, whatever the factory
    level = logging.DEBUG if _reuse_warned else logging.WARNING
    _reuse_warned = True
    log.log(
        level,
        "epoch %d has %d samples for its %d (samples_per_epoch): it serves some of them twice. A snapshot pins at "
        "most the epoch room (cache.max_bytes less cache.turnover and a 1 MiB reserve): lower samples_per_epoch, or "
        "give the cache more room",
        epoch,
        have,
        want,
    )
