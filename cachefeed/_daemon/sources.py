"""The daemon's inputs: one catalog and one sampling plan per source, and which source a sampler fetches next.

The single ``[remote]`` form is one unnamed input (tag 0); ``[[source]]`` tables are one input each (tag from the
name, ``_cache/sources.py``). Each input partitions, passes, skips and quarantines on its own (``plan.py``), so node
partitioning, pacing and quarantine work per source unchanged. What this module adds:

* **Global object ids.** A plan numbers its objects 0, 1, ...; the supervisor and the samplers see
  ``oid * len(inputs) + input index`` (with one input, the plan's own numbers).
* **Weighted ingest.** The cache should hold each source's share of samples (its normalised weight). When a
  sampler may change source, it is given the source furthest below its share, counting cached samples plus
  objects in flight (times that source's samples per object so far); sources with nothing to draw right now are
  skipped, so a small source that is wholly cached never stalls the others.
* **Single-source segments.** Every segment holds one source (its tag is in the trailer; the sampler's writer
  publishes the open segment when the next object is another source's). To keep segments full, a sampler keeps
  its source (*affinity*) until it publishes a segment; only then is it pointed at the neediest source again.

Epochs get their exact shares on the trainer side (``_trainer/partition.py: weighted_order``); the cache's shares
only need to be close, and they are within about one segment per sampler.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from cachefeed._cache.records import Source
from cachefeed._cache.sources import SourceEntry, read_sources, write_sources
from cachefeed._config import Config, SourceConfig
from cachefeed._daemon.catalog import Catalog, CatalogState
from cachefeed._daemon.pass_file import PassFileWriter
from cachefeed._daemon.plan import PlanCounters, SamplingPlan
from cachefeed._errors import ConfigError
from cachefeed._logs import get_logger
from cachefeed._remote import RemoteObject
from cachefeed._scrub import safe_url

__all__ = ["Input", "Inputs"]

log = get_logger(__name__)


@dataclass(slots=True)
class Input:
    """One source at run time."""

    index: int
    config: SourceConfig
    tag: int
    weight: float  # normalised
    plan: SamplingPlan
    catalog: Catalog | None = None
    samples_total: int = 0  # published samples of this source (ingest)
    bytes_total: int = 0  # published bytes of this source
    objects_done: int = 0  # objects whose samples were all published (or that had none)
    catalog_revision: int = -1  # the plan's revision kept in the restart catalog
    catalog_too_large: bool = False  # said once
    pass_file: PassFileWriter | None = None  # keeps how far the plan's pass got (pass_file.py)
    is_joining: bool = False  # a page of the current listing added objects already (logged once per listing)

    @property
    def name(self) -> str:
        return self.config.name

    def samples_per_object(self) -> float:
        return self.samples_total / self.objects_done if self.objects_done else 1.0


class Inputs:
    """Every input of the daemon (see the module docstring). Main loop only, except the catalogs' threads."""

    def __init__(self, config: Config) -> None:
        self.config = config
        sources, weights = config.inputs(), config.weights()
        self.inputs = [
            Input(
                index,
                source,
                source.tag if config.sources else 0,
                weights[index],
                SamplingPlan(
                    seed=config.sampler.seed,
                    rank=config.node.rank,
                    count=config.node.count,
                    name=source.name if config.sources else "",
                ),
            )
            for index, source in enumerate(sources)
        ]
        self.is_named = bool(config.sources)
        self._by_tag = {entry.tag: entry for entry in self.inputs}
        self._affinity: dict[int, int] = {}  # sampler key -> index of the input it writes now

    # -- set-up -----------------------------------------------------------------------------------------------

    def open_catalogs(self) -> None:
        """Create each input's catalog. Its URL is validated here: a ConfigError names the config file and the
        key (``remote.url``, or ``source[i].url`` for a named source)."""
        for entry in self.inputs:
            if entry.catalog is not None:
                continue
            try:
                entry.catalog = Catalog(
                    self.config.remote_for(entry.config),
                    name=entry.name,
                    rank=self.config.node.rank,
                    count=self.config.node.count,
                    label=self.config.sampler.label,
                )
            except ConfigError as exc:
                key = f"source[{entry.index}].url" if self.is_named else "remote.url"
                reason = str(exc).removeprefix("remote.url = ")
                raise ConfigError(f"{self.config.source}: {key} = {reason}") from None

    def write_table(self, path: str, *, mode: int) -> None:
        """Tell trainers the named sources (``sources.json``); without named sources, remove a stale table. Weights
        changed since the table the last daemon wrote are said once: the cache keeps its samples (weights do not
        change what a sample is) and moves toward the new shares as it turns over, so status shows the old mix for
        a while, and a source smaller than its new share stays below it, cached whole."""
        if self.is_named:
            entries = [SourceEntry(e.name, e.tag, e.weight) for e in self.inputs]
            before = {entry.name: entry.weight for entry in read_sources(path)}
            moved = [e for e in entries if e.name in before and abs(before[e.name] - e.weight) > 1e-9]
            if moved:
                log.info(
                    "source weights changed since the last start: %s; the cached samples are kept and the cache "
                    "moves toward the new shares as it turns over (a source smaller than its share stays cached "
                    "whole, below it)",
                    ", ".join(f"{e.name!r} {before[e.name]:.0%} -> {e.weight:.0%}" for e in moved),
                )
            write_sources(path, entries, mode=mode)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def made_with(self) -> dict[int, dict[str, Any]]:
        """Per tag, the settings that decide what its cached samples are (``made_with.json``, ``_cache/sources.py``)."""
        sampler, node = self.config.sampler, self.config.node
        return {
            entry.tag: {
                "url": safe_url(entry.config.url),  # never a password: the file is group-readable, and logged
                "pattern": entry.config.pattern,
                "decode": entry.config.decode or sampler.decode,
                "decode_images": sampler.decode_images,
                "image_fields": list(sampler.image_fields),
                "image_size": None if sampler.image_size is None else list(sampler.image_size),
                "label": sampler.label,
                "preprocess": sampler.preprocess,
                "node.rank": node.rank,
                "node.count": node.count,
            }
            for entry in self.inputs
        }

    def of_source(self, tag: int) -> str:
        """How a message names the source of ``tag`` after "samples": " of source 'crawl'", or "" (one remote)."""
        return f" of source {self._by_tag[tag].name!r}" if self.is_named else ""

    def catalogs(self) -> list[Catalog]:
        return [entry.catalog for entry in self.inputs if entry.catalog is not None]

    # -- ids --------------------------------------------------------------------------------------------------

    def gid(self, entry: Input, oid: int) -> int:
        return oid * len(self.inputs) + entry.index

    def split(self, gid: int) -> tuple[Input, int]:
        oid, index = divmod(gid, len(self.inputs))
        return self.inputs[index], oid

    def _by_input(self, gids: Iterable[int]) -> dict[int, list[int]]:
        grouped: dict[int, list[int]] = {}
        for gid in gids:
            entry, oid = self.split(gid)
            grouped.setdefault(entry.index, []).append(oid)
        return grouped

    # -- drawing ----------------------------------------------------------------------------------------------

    def draw(self, key: int, n: int, cached: Mapping[int, int]) -> tuple[Input, list[tuple[int, RemoteObject]]]:
        """Up to ``n`` objects for sampler ``key``, all of one input; ``cached`` is samples cached by tag."""
        current = self._affinity.get(key)
        for index in self._preference(current, cached):
            entry = self.inputs[index]
            drawn = entry.plan.next(n)
            if drawn:
                self._affinity[key] = index
                return entry, [(self.gid(entry, oid), obj) for oid, obj in drawn]
        return self.inputs[0], []

    def _preference(self, current: int | None, cached: Mapping[int, int]) -> list[int]:
        """Inputs to try in order: the sampler's current one, then the furthest below its share first."""
        if len(self.inputs) == 1:
            return [0]
        have = [cached.get(e.tag, 0) + e.plan.in_flight * e.samples_per_object() for e in self.inputs]
        total = sum(have)
        order = sorted(range(len(self.inputs)), key=lambda i: (have[i] - self.inputs[i].weight * total, -i))
        if current is not None:
            order.remove(current)
            order.insert(0, current)
        return order

    def segment_published(self, key: int) -> None:
        """Sampler ``key`` published a segment: it may be pointed at another source now."""
        self._affinity.pop(key, None)

    def forget_sampler(self, key: int) -> None:
        self._affinity.pop(key, None)

    # -- outcomes (global ids) ----------------------------------------------------------------------------------

    def requeue(self, gids: Iterable[int]) -> None:
        for index, oids in self._by_input(gids).items():
            self.inputs[index].plan.requeue(oids)

    def done(self, gids: Sequence[int], seq: int | None) -> None:
        """Objects whose samples are all published, the last one in segment ``seq`` (None: no samples)."""
        for index, oids in self._by_input(gids).items():
            entry = self.inputs[index]
            entry.plan.done(oids, seq)
            entry.objects_done += len(oids)

    def spanning(self, cuts: Sequence[Sequence[int]], seq: int) -> None:
        """Objects still being written with samples in segment ``seq``, as ``[gid, cut]``
        (``SamplingPlan.spanning``)."""
        for gid, cut in cuts:
            entry, oid = self.split(gid)
            entry.plan.spanning([(oid, cut)], seq)

    def published(self, tag: int, samples: int, nbytes: int) -> None:
        """A segment of source ``tag`` was published (ingest per source)."""
        entry = self._by_tag.get(tag)
        if entry is not None:
            entry.samples_total += samples
            entry.bytes_total += nbytes

    def failed(self, gid: int, kind: str) -> None:
        entry, oid = self.split(gid)
        entry.plan.failed(oid, kind)

    def adopt(self, seq: int, tag: int, sources: Iterable[Source]) -> None:
        """A recovered segment of source ``tag`` (see ``SamplingPlan.adopt``); a source no longer configured is
        ignored: its segments stay until evicted, and are never fetched again."""
        entry = self._by_tag.get(tag)
        if entry is not None:
            entry.plan.adopt(seq, sources)

    def evicted(self, seqs: Iterable[int]) -> None:
        gone = list(seqs)
        for entry in self.inputs:
            entry.plan.evicted(gone)

    def cached_segments(self) -> set[int]:
        segments: set[int] = set()
        for entry in self.inputs:
            segments |= entry.plan.cached_segments()
        return segments

    # -- views ------------------------------------------------------------------------------------------------

    @property
    def counters(self) -> PlanCounters:
        """The plans' counters, summed; but ``passes_completed`` is the passes every source completed (which see)."""
        total = PlanCounters()
        for entry in self.inputs:
            for item in fields(PlanCounters):
                setattr(total, item.name, getattr(total, item.name) + getattr(entry.plan.counters, item.name))
        total.passes_completed = self.passes_completed
        return total

    @property
    def passes_completed(self) -> int:
        """The passes every source completed (the least): trainers read ``>= 1`` as "everything the remote lists
        was visited", and one source done (a small one, or one whose objects were all cached at a restart) must not
        say so while another still fetches."""
        return min((entry.plan.counters.passes_completed for entry in self.inputs), default=0)

    @property
    def pass_index(self) -> int:
        """The pass every input has reached (the lowest)."""
        return min(entry.plan.pass_index for entry in self.inputs)

    @property
    def owned(self) -> int:
        return sum(entry.plan.owned for entry in self.inputs)

    @property
    def in_flight(self) -> int:
        return sum(entry.plan.in_flight for entry in self.inputs)

    @property
    def dropped(self) -> int:
        return sum(entry.plan.dropped for entry in self.inputs)

    @property
    def not_cached(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.inputs:
            for reason, n in entry.plan.not_cached.items():
                counts[reason] = counts.get(reason, 0) + n
        return counts

    def catalog_state(self) -> CatalogState:
        """The listings, summed: failing if any input's latest listing failed."""
        states = [catalog.state() for catalog in self.catalogs()]
        failing = [state for state in states if state.is_failing]
        return CatalogState(
            sum(state.objects_listed for state in states),
            min((state.last_listed_at for state in states), default=0.0),
            sum(state.list_errors_total for state in states),
            failing[0].last_error if failing else "",
            bool(failing),
            sum(state.list_requests_total for state in states),
            sum(state.list_requests_per_hour for state in states),
            max((state.refresh_interval_s for state in states), default=0.0),
            max((state.last_listing_s for state in states), default=0.0),
        )

    def empty_listings(self) -> list[str]:
        """One line per input whose latest listing matched nothing."""
        lines = []
        for entry in self.inputs:
            if entry.catalog is None:
                continue
            state = entry.catalog.state()
            if state.last_listed_at and state.objects_listed == 0 and not state.is_failing:
                where = f"source {entry.name!r}: " if self.is_named else ""
                keys = f"source[{entry.index}].url and .pattern" if self.is_named else "remote.url and remote.pattern"
                lines.append(
                    f"{where}the remote lists 0 objects under {safe_url(entry.config.url)}"
                    f"{entry.catalog.why_empty()} matching "
                    f"{entry.config.pattern!r}: check {keys} (its cached samples are kept, and epochs read them, "
                    "until it lists objects again)"
                )
        return lines

    def uncacheable(self) -> list[str]:
        """One line per input every listed object of which was refused (dropped or quarantined): such a daemon
        caches nothing, and used to say it was running once its failed requests left the error window."""
        lines = []
        for entry in self.inputs:
            refused = entry.plan.not_cached
            if entry.plan.owned and sum(refused.values()) >= entry.plan.owned:
                where = f"source {entry.name!r}: " if self.is_named else ""
                reasons = ", ".join(f"{kind}: {n}" for kind, n in sorted(refused.items()))
                lines.append(
                    f"{where}none of the {entry.plan.owned} listed objects can be cached ({reasons}): the log "
                    "names why; fix the cause and send SIGHUP (a 401/403 is tried again then)"
                )
        return lines

    def table(self, cached: Mapping[int, int]) -> list[dict[str, object]]:
        """The status document's ``sources`` list (named sources only)."""
        if not self.is_named:
            return []
        total = sum(cached.get(entry.tag, 0) for entry in self.inputs)
        rows: list[dict[str, object]] = []
        for entry in self.inputs:
            state = entry.catalog.state() if entry.catalog is not None else CatalogState(0, 0.0, 0, "", False)
            counters = entry.plan.counters
            samples = cached.get(entry.tag, 0)
            plan, objects_cached = entry.plan, entry.plan.cached_objects
            # every owned object it can cache is cached (those refused, ``not_cached``, cannot be)
            whole = (
                plan.owned > 0 and objects_cached > 0 and objects_cached + sum(plan.not_cached.values()) >= plan.owned
            )
            rows.append(
                {
                    "name": entry.name,
                    "url": safe_url(entry.config.url),
                    "weight": entry.weight,
                    "cached_samples": samples,
                    "cached_share": samples / total if total else None,
                    "objects_listed": state.objects_listed,
                    "objects_cached": objects_cached,
                    "cached_whole": whole,
                    "list_errors_total": state.list_errors_total,
                    "objects_total": counters.done_total,
                    "samples_total": entry.samples_total,
                    "bytes_total": entry.bytes_total,
                    "objects_failed_total": counters.failed_total,
                    "not_cached": entry.plan.not_cached,
                    "pass": entry.plan.pass_index,
                    "passes_completed": counters.passes_completed,
                }
            )
        return rows
