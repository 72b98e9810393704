"""Epoch reads: what each epoch served, the receipts trainers leave, and the daemon's per-sample ledger.

The contract between the daemon and its trainers is reads, not time: a segment may be evicted only once training
has read it enough (``cache.evict_after_reads``, ``_cache/store.py``). This module owns what "read" means, how a
read is reported and how it is remembered; both sides import it.

NOTE [ Read receipts ]
----------------------
**Definitions** (every rule of the daemon, the status lines and the metrics follow these, and nothing else):

* An epoch *serves* a sample when the batch holding it reaches the training loop: ``EpochLoader``'s iterator hands
  the batch out, less any batch a look-ahead the package owns (``DevicePrefetcher``) holds but has not yielded. A
  record that fails verification inside a served batch counts as served (no epoch could ever serve it; counting it
  lets its segment go). With ``factory.dataset()``/``share()`` (the user's own DataLoader) the factory cannot see
  batches: the released epoch counts as having served this rank's share.
* A sample's *reads* are the number of epochs that served it. An epoch counts at most once per sample, whichever
  ranks and workers served it and however often (a small cache re-used within one epoch of a set size).
* A segment's *reads* are the reads of its least-read sample. ``cache.evict_after_reads = k``: a segment may be
  evicted once **every sample in it has been served by at least k epochs**. ``most-read`` eviction orders by
  segment reads (then by the segment's total sample reads). "Cached samples not read yet" counts samples with
  0 reads; "evicted unread" counts samples that had 0 reads when their segment went (0 at ``k >= 1`` by this
  definition); reads per sample are the mean of the per-sample reads.

**Protocol.** Processes: trainer ranks (any number per snapshot) record what they served; whoever removes the
snapshot (its last holder, or the daemon's sweep once its holders died: NOTE [ Snapshot pinning protocol ] in
``snapshots.py``) turns that into one receipt; the daemon consumes receipts.

1. A rank, before it releases its pin, writes ``snapshots/<id>/served.<pid>.<rand>`` atomically: a bitmap over
   the snapshot's sample indices (segments in MANIFEST order) of the samples it served. Nothing served, nothing
   written. A rank killed before it writes leaves nothing: its samples count as unread (kept longer, never evicted
   early); a job resumed from a checkpoint credits the batches the checkpoint says were consumed. The bitmap covers
   the whole snapshot whatever share the rank served, so each record takes ``served_record_bytes`` of the cache,
   and the daemon charges them ahead for every rank of every live snapshot (``store.py``, the budget).
2. The remover, holding the snapshot's lock exclusively: (a) unless ``<id>/RECEIPT`` exists, takes the union of the
   served files into one receipt (per segment: its name, sample count and a bitmap of its served samples) and
   writes it atomically as ``<id>/RECEIPT`` (nothing served: no receipt); (b) unlinks the served files; (c) renames
   ``<id>/RECEIPT`` to ``snapshots/<id>.<nonce>.receipt`` (the nonce is the snapshot's own, from its MANIFEST);
   (d) removes the directory, then the lock. A kill after (a) leaves ``RECEIPT``, which the next remover passes on
   without taking the union again; after (c) neither a served file nor ``RECEIPT`` is left: **a receipt is emitted
   at most once per snapshot**, whatever kills whom when. Where no daemon holds the cache's writer lock and none
   wrote its status in the last 5 minutes (a static cache, not a daemon restarting), (a)-(c) are skipped: nobody
   would collect receipts, and reads missed only keep data longer. A daemon restarting (systemd's delay, a crash
   loop) collects the receipts left meanwhile when it starts (step 3 runs at its recovery's pin scan).
3. The daemon (``ReadLedger``) reads every receipt, adds one read to each served sample of each named segment it
   still publishes with the same sample count, writes its ledger ``reads`` (per-sample counts per segment name and
   the names of the receipts it just applied) atomically, and only then unlinks the receipts. After a crash between
   the two steps, a receipt named in the ledger is unlinked without being counted again. A segment the ledger does
   not name counts as unread: a lost or corrupt ledger makes the daemon keep data longer, never evict it early.
4. A trainer creating a snapshot reads the ledger and the receipts not applied yet (``reads_with_receipts``: an
   epoch released a moment ago has read its samples, whether or not the daemon collected its receipt yet) and
   writes each segment's reads into the MANIFEST (``encode_reads``: the segment's reads and a bitmap of its samples
   read more than that), so every rank of the epoch, and a resumed job, draws the same least-read-first order
   (``_trainer/partition.py``).
"""

from __future__ import annotations

import os
import secrets
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from cachefeed._fsutil import atomic_write
from cachefeed._logs import get_logger

__all__ = [
    "LEDGER_NAME",
    "RECEIPT_SUFFIX",
    "SERVED_PREFIX",
    "STAGED_RECEIPT",
    "ReadLedger",
    "Receipt",
    "SampleReads",
    "decode_reads",
    "emit_receipt",
    "encode_reads",
    "read_counts",
    "reads_with_receipts",
    "served_record_bytes",
    "write_served",
]

log = get_logger(__name__)

SERVED_PREFIX = "served."
STAGED_RECEIPT = "RECEIPT"
RECEIPT_SUFFIX = ".receipt"
LEDGER_NAME = "reads"
_LEDGER_VERSION = 2
_RECEIPT_VERSION = 2
_MAX_READS = np.iinfo(np.uint16).max  # reads saturate there: far above any evict_after_reads

Counts = npt.NDArray[np.uint16]


# -- per-sample reads ----------------------------------------------------------------------------------------------


class SampleReads:
    """The reads of each sample of one segment (NOTE above), with the segment-level figures derived from them."""

    __slots__ = ("counts", "level", "total", "unread")

    def __init__(self, counts: Counts) -> None:
        self.counts = counts
        self.level = int(counts.min()) if len(counts) else 0  # the segment's reads: its least-read sample's
        self.total = int(counts.sum(dtype=np.int64))
        self.unread = int(np.count_nonzero(counts == 0))

    @classmethod
    def none(cls, samples: int) -> SampleReads:
        return cls(np.zeros(samples, dtype=np.uint16))

    def served(self, bits: bytes) -> SampleReads:
        """These reads plus one epoch that served the samples set in ``bits`` (a packed bitmap)."""
        mask = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=len(self.counts)).astype(bool)
        counts = self.counts.copy()
        counts[mask & (counts < _MAX_READS)] += 1
        return SampleReads(counts)

    def below(self, k: int) -> int:
        """Samples served fewer than ``k`` times."""
        return int(np.count_nonzero(self.counts < k)) if k > self.level else 0


def encode_reads(counts: Counts) -> tuple[int, bytes]:
    """A segment's reads for a MANIFEST: its level (least-read sample) and a packed bitmap of the samples read more
    than that (empty when none): exact for the least-read-first order, ``len(counts) / 8`` bytes at most."""
    level = int(counts.min()) if len(counts) else 0
    above = counts > level
    return level, (np.packbits(above).tobytes() if above.any() else b"")


def decode_reads(samples: int, level: int, above: bytes) -> npt.NDArray[np.int64]:
    """Per-sample reads for ordering, from ``encode_reads``'s pair: ``level``, or ``level + 1`` where marked."""
    reads = np.full(samples, level, dtype=np.int64)
    if above:
        reads += np.unpackbits(np.frombuffer(above, dtype=np.uint8), count=samples).astype(np.int64)
    return reads


# -- the trainer's side: what a rank served, and the receipt of a removed snapshot ----------------------------------


# What msgpack puts around a served record's bitmap, at most: a 2-entry map (1 byte), its keys "samples" (8) and
# "bits" (5), the sample count as a uint64 (9) and the bitmap's bin32 header (5). ``write_served`` writes that
# document and no other; ``served_record_bytes`` counts on it.
_SERVED_FRAME_BYTES = 28


def served_record_bytes(samples: int, block_bytes: int = 1) -> int:
    """The most one rank's served record (``write_served``) of a snapshot of ``samples`` samples takes on disk: its
    bitmap, one bit per sample of the whole snapshot whatever share the rank served, and the msgpack around it,
    rounded up to ``block_bytes``, the filesystem's allocation unit (1: the file's size). The one owner of the
    rule: the store charges it ahead for each rank that has yet to write (``store.py``, the budget), and
    ``tests/cache/test_bound.py`` checks the writer against it."""
    nbytes = _SERVED_FRAME_BYTES + (samples + 7) // 8
    return -(-nbytes // block_bytes) * block_bytes


def write_served(directory: Path, served: npt.NDArray[np.int64], samples: int, *, mode: int = 0o640) -> None:
    """Record that this rank served the snapshot's samples ``served`` (indices into its ``samples``) (step 1): one
    file of at most ``served_record_bytes(samples)`` bytes, whatever the share."""
    if len(served) == 0:
        return
    mask = np.zeros(samples, dtype=bool)
    mask[served] = True
    document = {"samples": samples, "bits": np.packbits(mask).tobytes()}
    name = f"{SERVED_PREFIX}{os.getpid()}.{secrets.token_hex(4)}"
    atomic_write(directory / name, msgpack.packb(document), mode=mode)


def _served_union(directory: Path, samples: int) -> npt.NDArray[np.bool_]:
    union = np.zeros(samples, dtype=bool)
    for entry in os.scandir(directory):
        if not entry.name.startswith(SERVED_PREFIX) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            document = msgpack.unpackb(Path(entry.path).read_bytes(), raw=False)
            recorded = int(document["samples"])
            if recorded > samples:  # fewer is a prefix: a growing snapshot only appends (``_trainer/growing.py``)
                raise ValueError(f"{recorded} samples, the snapshot has {samples}")
            bits = np.frombuffer(document["bits"], dtype=np.uint8)
            union[:recorded] |= np.unpackbits(bits, count=recorded).astype(bool)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring an unreadable served record %s (%s): its samples count as unread", entry.path, exc)
    return union


def emit_receipt(directory: Path, segments: list[tuple[str, int]], nonce: str, *, mode: int = 0o640) -> bool:
    """Steps 2(a)-(c) of the NOTE for the snapshot in ``directory`` (segments: ``(name, samples)`` in MANIFEST
    order). The caller holds the snapshot's lock exclusively and removes the directory next. True if a receipt
    was handed to the daemon."""
    staged = directory / STAGED_RECEIPT
    if not staged.exists():
        counts = np.array([count for _name, count in segments], dtype=np.int64)
        union = _served_union(directory, int(counts.sum()))
        if not union.any():
            return False
        starts = np.concatenate(([0], np.cumsum(counts)))
        entries = []
        for (name, count), start in zip(segments, starts[:-1].tolist(), strict=True):
            mask = union[start : start + count]
            if mask.any():
                entries.append([name, count, np.packbits(mask).tobytes()])
        document = {"version": _RECEIPT_VERSION, "snapshot": directory.name, "segments": entries, "at": time.time()}
        atomic_write(staged, msgpack.packb(document), mode=mode)
    for entry in os.scandir(directory):
        if entry.name.startswith(SERVED_PREFIX):
            Path(entry.path).unlink(missing_ok=True)
    os.rename(staged, directory.parent / f"{directory.name}.{nonce}{RECEIPT_SUFFIX}")
    return True


# -- the daemon's side ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Receipt:
    """One epoch's served samples of one snapshot, as the daemon finds it in ``snapshots/``.

    ``segments``: ``(segment name, its sample count, packed bitmap of the samples the epoch served)``.
    """

    name: str  # the receipt's file name
    snap_id: str
    segments: tuple[tuple[str, int, bytes], ...]


def _pack_counts(counts: Counts) -> bytes:
    return zlib.compress(counts.astype("<u2", copy=False).tobytes(), 1)


def _unpack_counts(blob: bytes) -> Counts:
    return np.frombuffer(zlib.decompress(blob), dtype="<u2").astype(np.uint16)


def _load_ledger(path: Path) -> dict[str, Any]:
    document = msgpack.unpackb(path.read_bytes(), raw=False)
    if not isinstance(document, dict) or document.get("version") != _LEDGER_VERSION:
        raise ValueError("not a ledger of this version")
    return document


def read_counts(root: Path) -> dict[str, Counts]:
    """The ledger's per-sample reads per segment name, for trainers: empty if there is none or it is unreadable."""
    return _ledger_counts(root)[0]


def _ledger_counts(root: Path) -> tuple[dict[str, Counts], frozenset[str]]:
    try:
        document = _load_ledger(root / LEDGER_NAME)
        counts = {str(name): _unpack_counts(blob) for name, blob in document["counts"].items()}
        return counts, frozenset(str(name) for name in document["applied"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, zlib.error):
        return {}, frozenset()


def reads_with_receipts(root: Path, snapshots: Path) -> dict[str, Counts]:
    """The ledger's per-sample reads plus those of the receipts the daemon has not applied yet, for a trainer
    choosing what an epoch reads (``room.py``): an epoch released a moment ago has read its samples even though its
    receipt is still waiting for the daemon's next collection.

    Receipts are listed before the ledger is read, so a receipt the daemon applies meanwhile is counted (the ledger
    has it), never missed; one it applied and unlinked between the two looks may count twice (a segment then looks
    read once more than it is: kept for later, never served as unread)."""
    receipts: list[Receipt] = []
    try:
        entries = [e for e in os.scandir(snapshots) if e.name.endswith(RECEIPT_SUFFIX)]
    except FileNotFoundError:
        entries = []
    for entry in entries:
        try:
            receipts.append(_parse_receipt(Path(entry.path))[1])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # gone (applied: in the ledger now) or unreadable (the daemon removes it)
    counts, applied = _ledger_counts(root)
    for receipt in receipts:
        if receipt.name in applied:
            continue
        for name, samples, bits in receipt.segments:
            known = counts.get(name)
            base = SampleReads(known) if known is not None and len(known) == samples else SampleReads.none(samples)
            counts[name] = base.served(bits).counts
    return counts


def _parse_receipt(path: Path) -> tuple[float, Receipt]:
    """A receipt file's time and contents (``OSError``/``ValueError``/``KeyError``/``TypeError`` if unreadable)."""
    document = msgpack.unpackb(path.read_bytes(), raw=False)
    if document.get("version") != _RECEIPT_VERSION:
        raise ValueError(f"receipt version {document.get('version')!r}, expected {_RECEIPT_VERSION}")
    segments = tuple((str(n), int(c), bytes(b)) for n, c, b in document["segments"])
    return float(document.get("at", 0.0)), Receipt(path.name, str(document["snapshot"]), segments)


class ReadLedger:
    """The daemon's side: collects receipts and keeps the per-sample counts in ``<root>/reads`` (single writer)."""

    def __init__(self, root: Path, snapshots: Path, *, file_mode: int = 0o640) -> None:
        self.path = root / LEDGER_NAME
        self._snapshots = snapshots
        self._file_mode = file_mode
        self._applied: frozenset[str] = frozenset()
        self._unsaved: set[str] = set()  # receipts credited in memory whose counts the ledger does not hold yet
        self.epochs_total = 0

    def load(self) -> dict[str, Counts]:
        """The per-sample counts per segment name as last committed (empty if there is no ledger, or it cannot be
        read: every segment then counts as unread)."""
        try:
            document = _load_ledger(self.path)
            counts = {str(name): _unpack_counts(blob) for name, blob in document["counts"].items()}
            self._applied = frozenset(str(name) for name in document["applied"])
            self.epochs_total = int(document["epochs_total"])
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError, zlib.error) as exc:
            log.warning("ignoring the read ledger %s (%s): every cached segment counts as unread", self.path, exc)
            return {}
        return counts

    def pending(self) -> list[Receipt]:
        """Receipts not applied yet, oldest first. Receipts the ledger already applied are removed here."""
        receipts: list[tuple[float, Receipt]] = []
        try:
            entries = [e for e in os.scandir(self._snapshots) if e.name.endswith(RECEIPT_SUFFIX)]
        except FileNotFoundError:
            return []
        for entry in entries:
            if entry.name in self._applied:
                Path(entry.path).unlink(missing_ok=True)
                continue
            if entry.name in self._unsaved:  # credited; kept until the ledger holds it (``commit``)
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    raise ValueError("not a regular file")
                receipts.append(_parse_receipt(Path(entry.path)))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("removing an unreadable read receipt %s (%s)", entry.name, exc)
                Path(entry.path).unlink(missing_ok=True)
        return [receipt for _at, receipt in sorted(receipts, key=lambda pair: pair[0])]

    @property
    def has_unsaved(self) -> bool:
        """Whether receipts were credited that the ledger file does not hold yet (a ``commit`` that failed)."""
        return bool(self._unsaved)

    def commit(self, applied: Iterable[Receipt], counts: Mapping[str, Counts]) -> None:
        """Persist ``counts`` (after ``applied`` was credited), then remove the applied receipts.

        ``OSError`` (a full filesystem, say) leaves the receipts where they are and remembers them as credited: they
        are not credited again, and the next ``commit`` (with or without new receipts) writes them all. A daemon
        that dies before that reads the last ledger written and credits them then, once."""
        applied = list(applied)
        self.epochs_total += len(applied)
        self._unsaved.update(receipt.name for receipt in applied)
        names = frozenset(self._unsaved)
        document = {
            "version": _LEDGER_VERSION,
            "counts": {name: _pack_counts(c) for name, c in counts.items()},
            "applied": sorted(names),
            "epochs_total": self.epochs_total,
        }
        atomic_write(self.path, msgpack.packb(document), mode=self._file_mode)
        self._applied = names
        self._unsaved.clear()
        for name in names:
            (self._snapshots / name).unlink(missing_ok=True)
