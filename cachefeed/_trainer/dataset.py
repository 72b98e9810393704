"""The snapshot dataset: a map-style view of one pinned epoch snapshot, read zero-copy from memory maps.

Why map-style with a batch sampler rather than an ``IterableDataset`` split by ``get_worker_info()``:

* **exact once, by construction**: the DataLoader's main process hands each batch of indices to exactly one
  worker and reassembles them in order, so every index of the rank's share is fetched once, whatever the number
  of workers, their start method, or a worker that is slower than the others. An iterable split needs each worker
  to compute its own slice and trust that all workers agree, and ends with one short batch *per worker*.
* **throughput**: a batch travels to a worker as one small int64 array (2 KiB for 256 samples) and is fetched by
  ``__getitems__`` with one vectorised ``searchsorted``; work is balanced dynamically (a worker gets the next
  batch when it has room), so one slow worker does not stretch the epoch. The per-batch cost of the index queue
  is microseconds, far below the cost of reading the batch.
* ``len(loader)`` is exact and equal on every rank, which DDP needs.

Memory: the index is two numpy arrays (segment names and cumulative sample counts), not per-sample Python objects,
so reading it in a forked worker touches no reference counts and copies no pages (no copy-on-access growth).
Segment readers are opened lazily in the process that reads (never pickled: ``__getstate__`` drops them) and
stay open for the life of the dataset; their maps are file pages of the cache (tmpfs/page cache), shared by all
processes that read the same segment.

Tensors handed out are ``torch.from_numpy`` views of the copy-on-write map (writable, so torch does not warn; a
write changes only the writer's private copy of that page, never the cache). Arrays are stored contiguous and
aligned (64 bytes from 4 KiB, 16 below: ``_cache/records.py``), so every tensor is contiguous.

Per sample, a worker (or, with ``num_workers=0``, the training thread) pays the reader's decode and one
``torch.from_numpy`` per array, nothing else; a worker of the pool collating by default copies the reader's arrays
into the batch as they are, without the tensors (``iter_items(tensors=False)``). A one-off measurement (2026-11-23,
2 shared CPUs, Python 3.11.7, torch 2.13.0+cpu: ``python -m benchmarks.record_cost`` from the repository root,
median of 20 passes): ``__getitems__`` of 32 shuffled records of one 128 KiB array each, ``verify=False``, took
0.78-0.82 ms at 1023a54 (format 3, flags checked per array) and 0.34-0.36 ms since (about 11 us a sample, of which
about 5 the reader's and 2 ``torch.from_numpy``'s). A batch (``__getitems__``, ``read_items``) is read in one
loop over its records (``records.read_records``), which pays per sample what ``read`` pays less its per-call
lookups and the second pass of ``as_tensors``; it matters for small samples, where that Python is most of a
sample's cost.

Corrupt records: ``__getitems__`` (the batched path the DataLoader uses) skips a record that fails verification
(``CorruptRecordError``), logs it and counts it in ``skipped``; the batch then holds *fewer* samples (never a
replacement: a replacement would deliver another sample twice in the epoch). A batch whose every record is corrupt
becomes an empty list; ``loader.py`` drops such batches. ``__getitem__`` (one sample) raises
``CorruptRecordError`` instead, since it has no batch to shrink. A sample the transform raises ``DecodeError`` for
(``DecodeImages``: an image that does not decode) is skipped and counted alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Dataset, get_worker_info

from cachefeed._cache.records import SegmentReader, read_records
from cachefeed._cache.snapshots import Snapshot
from cachefeed._cache.sources import SOURCE_FIELD
from cachefeed._errors import CorruptRecordError, DecodeError, SnapshotError
from cachefeed._logs import get_logger
from cachefeed._trainer.counters import SlotCounters

__all__ = ["Sample", "SnapshotDataset", "Transform", "as_tensors"]

log = get_logger(__name__)

# Slot 0 for a DataLoader without workers, then one per worker id; beyond that, workers share slots modulo the
# count (a race that can only under-count, and only with more than 256 workers).
COUNTER_SLOTS = 257

Sample = dict[str, Any]
Transform = Callable[[Sample], Any]


def as_tensors(sample: Sample) -> Sample:
    """``sample`` (a reader's dict, changed in place) with each numpy array a ``torch.from_numpy`` view: what the
    dataset hands out. An array torch has no tensor for (strings, objects, a non-native byte order) stays a numpy
    array."""
    for name, value in sample.items():
        if type(value) is np.ndarray:
            try:
                sample[name] = torch.from_numpy(value)
            except (TypeError, ValueError):  # ValueError: the byte order
                pass
    return sample


class _OpenSegments:
    """The segment readers open in this process, shared by every dataset that reads the same segment file.

    Consecutive snapshots hold mostly the same segments (hard links to one inode). A worker that lives across epochs
    reads each epoch through a new dataset; sharing readers by inode keeps the segment mapped, and its pages
    faulted in, from one epoch to the next instead of mapping it again every epoch. A reader closes when the last
    dataset using it closes, so a released snapshot's segments are unmapped as soon as no later snapshot holds them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._readers: dict[tuple[int, int], tuple[SegmentReader, int]] = {}  # (dev, inode) -> (reader, users)
        self._inodes: dict[int, tuple[int, int]] = {}  # id(reader) -> (dev, inode)

    def acquire(self, path: Path) -> SegmentReader:
        """A reader of ``path`` (FileNotFoundError if it is gone); pair with ``release``."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's readers are not ours to share or close
                self._readers, self._inodes, self._pid = {}, {}, os.getpid()
            stat = os.stat(path)
            inode = (stat.st_dev, stat.st_ino)
            held = self._readers.get(inode)
            if held is not None:
                self._readers[inode] = (held[0], held[1] + 1)
                return held[0]
            reader = SegmentReader(path)
            self._readers[inode] = (reader, 1)
            self._inodes[id(reader)] = inode
            return reader

    def share(self, path: Path) -> SegmentReader | None:
        """The reader of ``path`` if one is open in this process (then paired with ``release``), else None."""
        with self._lock:
            if self._pid != os.getpid() or not self._readers:
                return None
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                return None
            inode = (stat.st_dev, stat.st_ino)
            held = self._readers.get(inode)
            if held is None:
                return None
            self._readers[inode] = (held[0], held[1] + 1)
            return held[0]

    def release(self, reader: SegmentReader) -> None:
        with self._lock:
            inode = self._inodes.get(id(reader))
            held = self._readers.get(inode) if inode is not None else None
            if inode is None or held is None or held[0] is not reader:
                reader.close()  # not shared (opened before a fork): ours alone
                return
            if held[1] > 1:
                self._readers[inode] = (reader, held[1] - 1)
                return
            del self._readers[inode]
            del self._inodes[id(reader)]
        reader.close()


_OPEN = _OpenSegments()


class SnapshotDataset(Dataset[Any]):
    """All samples of one snapshot, indexed ``0 .. len-1`` in segment order (oldest segment first).

    The dataset does not hold the snapshot's pin: whoever built it (``EpochLoaderFactory``, or you with
    ``Snapshot.create``) keeps the snapshot held while the dataset is read. Readers opened before a release keep
    working (a map keeps its file alive); new ones fail with ``SnapshotError``.

    Args:
        directory: the snapshot directory holding the segment links.
        names: segment file names inside ``directory``.
        counts: samples in each segment (``len(counts) == len(names)``).
        transform: optional per-sample function, run where the sample is read (in the DataLoader workers).
        verify: check each record's checksum when reading (xxh3: cheap next to any training step). The checksum
            also binds the record to its key and position; with False nothing of a record's bytes is checked.
        snap_id: for messages only.
        sources: each segment's source name (named sources, ``_cache/sources.py``): every sample read from segment
            ``i`` gets the field ``"__source__" = sources[i]``. Empty: no such field.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        names: Sequence[str],
        counts: Sequence[int],
        *,
        transform: Transform | None = None,
        verify: bool = True,
        snap_id: str = "",
        sources: Sequence[str] = (),
    ) -> None:
        if len(names) != len(counts):
            raise ValueError(f"{len(names)} segment names but {len(counts)} counts")
        if any(int(c) < 0 for c in counts):
            raise ValueError("segment counts must be >= 0")
        self.directory = str(directory)
        self.snap_id = snap_id
        self.transform = transform
        self.verify = verify
        self._names: npt.NDArray[np.bytes_] = np.array([n.encode() for n in names], dtype=np.bytes_)
        if sources and len(sources) != len(names):
            raise ValueError(f"{len(names)} segment names but {len(sources)} source names")
        # per segment, an index into a few distinct names (no per-segment Python strings for workers to touch)
        self._source_names: tuple[str, ...] = tuple(sorted(set(sources)))
        self._source_of: npt.NDArray[np.int32] = np.array(
            [self._source_names.index(name) for name in sources], dtype=np.int32
        )
        self._starts: npt.NDArray[np.int64] = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(np.asarray(counts, dtype=np.int64), out=self._starts[1:])
        self.skip_counter = SlotCounters(COUNTER_SLOTS)
        self._readers: dict[int, SegmentReader] = {}
        self._pid = os.getpid()

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, **kwargs: Any) -> SnapshotDataset:
        """The dataset over a held snapshot (see the class docstring for who keeps it held)."""
        names = snapshot.sources
        sources = [names[tag][0] if tag in names else "" for tag in snapshot.tags] if names else []
        return cls(
            snapshot.directory, snapshot.names, snapshot.counts, snap_id=snapshot.snap_id, sources=sources, **kwargs
        )

    def extend(self, names: Sequence[str], counts: Sequence[int]) -> None:
        """Append segments (a growing snapshot's new generation, ``_trainer/growing.py``): every index keeps its
        sample. Not for a dataset of named sources (growing epochs do not weigh sources)."""
        if len(names) != len(counts) or any(int(c) < 0 for c in counts):
            raise ValueError(f"{len(names)} segment names but {len(counts)} counts (each >= 0)")
        if self._source_names:
            raise ValueError("a dataset of named sources cannot grow")
        self._names = np.concatenate((self._names, np.array([n.encode() for n in names], dtype=np.bytes_)))
        added = self._starts[-1] + np.cumsum(np.asarray(counts, dtype=np.int64))
        self._starts = np.concatenate((self._starts, added))

    # -- pickling: only the index travels to workers ---------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()

    # -- index ---------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def segments(self) -> int:
        return len(self._names)

    @property
    def skipped(self) -> int:
        """Corrupt records skipped so far by every process reading this dataset."""
        return self.skip_counter.total()

    def locate(self, indices: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Vectorised ``index -> (segment position, record number)``. Raises IndexError out of range."""
        flat = np.asarray(indices, dtype=np.int64)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= len(self)):
            raise IndexError(f"sample index out of range for a snapshot of {len(self)} samples")
        segment = np.searchsorted(self._starts, flat, side="right") - 1
        return segment, flat - self._starts[segment]

    def _reader(self, segment: int) -> SegmentReader:
        """This process's reader of a segment (opened on first use; a forked child opens its own)."""
        if self._pid != os.getpid():  # forked after readers were opened: reopen our own
            self._readers = {}
            self._pid = os.getpid()
        reader = self._readers.get(segment)
        if reader is None:
            name = self._names[segment].decode()
            try:
                reader = _OPEN.acquire(Path(self.directory) / name)
            except FileNotFoundError:
                raise SnapshotError(
                    f"segment {name} of snapshot {self.snap_id or self.directory} is gone: the snapshot was "
                    "released while its dataset was still read (keep the factory/snapshot open until the epoch ends)"
                ) from None
            self._readers[segment] = reader
        return reader

    def share_open_readers(self) -> int:
        """Take this process's open readers of this dataset's segments (another dataset's, an earlier epoch's
        still being read): the epoch builder calls it in the background so that the training thread does not map
        again, page by page, the segments consecutive epochs share. Returns how many were taken."""
        if self._pid != os.getpid():
            return 0
        taken = 0
        for segment, name in enumerate(self._names.tolist()):
            if segment not in self._readers:
                reader = _OPEN.share(Path(self.directory) / name.decode())
                if reader is not None:
                    self._readers[segment] = reader
                    taken += 1
        return taken

    # -- reading -------------------------------------------------------------------------------------------

    def _read(self, reader: SegmentReader, segment: int, record: int, *, tensors: bool = True) -> Any:
        """One sample of ``reader`` (segment ``segment``), arrays as tensors (numpy arrays with ``tensors=False`` and
        no transform). Raises CorruptRecordError.

        Paid once per sample, by a worker or (``num_workers=0``) the training thread: kept to the reader's
        decode, one ``torch.from_numpy`` per array and no per-sample checks the reader already guarantees
        (its arrays are writable and C-contiguous, compressed records' too).
        """
        sample = reader.read(record, verify=self.verify)
        if self._source_names:
            sample[SOURCE_FIELD] = self._source_names[self._source_of[segment]]
        if self.transform is not None:
            return self.transform(as_tensors(sample))
        return as_tensors(sample) if tensors else sample

    def __getitem__(self, index: int) -> Any:
        """One sample (a dict of tensors and scalars, ``"__key__"`` included). Raises CorruptRecordError."""
        segment, record = self.locate([index])
        return self._read(self._reader(int(segment[0])), int(segment[0]), int(record[0]))

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch of samples, corrupt records skipped and counted (see the module docstring)."""
        return self.read_items(indices)

    def read_items(self, indices: Sequence[int], *, tensors: bool = True) -> list[Any]:
        """``list(iter_items(indices, tensors=tensors))``, read in one pass: the samples, their order, the records
        skipped (counted and logged) and the transform's calls (in the batch's order) are ``iter_items``'s.

        Why: a batch of small samples costs more in per-sample Python than in bytes. The batch's records are read
        by ``records.read_records`` (one loop, arrays made tensors as they are read); a record it leaves is read
        by ``SegmentReader.read`` as ``iter_items`` reads it, so a compressed or corrupt record, a segment that
        does not open, or a record of another kind gets the one answer. ``iter_items`` stays for a worker copying
        each large sample into its batch as it is read (``RowCollator``).
        """
        segments, records = self.locate(indices)
        if self._pid != os.getpid():  # forked after readers were opened: reopen our own
            self._readers, self._pid = {}, os.getpid()
        wanted, where = records.tolist(), segments.tolist()
        opened = self._readers.get
        readers = [opened(segment) for segment in where]
        for position, reader in enumerate(readers):
            if reader is None:
                readers[position] = self._open(where[position])
        transform = self.transform
        wrap = torch.from_numpy if tensors or transform is not None else None
        samples: list[Any] = []
        skipped: set[int] = set()
        position, total, verify = 0, len(wanted), self.verify
        while True:
            position = read_records(readers, wanted, position, samples, verify=verify, wrap=wrap)
            if position >= total:
                break
            try:  # what the fast path left: read as ``iter_items`` reads it
                held = readers[position]  # None: its segment did not open, and ``_reader`` says why
                reader = self._reader(where[position]) if held is None else held
                sample = reader.read(wanted[position], verify=verify)
                samples.append(as_tensors(sample) if wrap is not None else sample)
            except CorruptRecordError as exc:
                self._skip(exc)
                skipped.add(position)
            position += 1
        if self._source_names:
            names, source_of = self._source_names, self._source_of
            kept = [segment for position, segment in enumerate(where) if position not in skipped]
            for sample, segment in zip(samples, kept, strict=True):
                sample[SOURCE_FIELD] = names[source_of[segment]]
        if transform is None:
            return samples
        transformed = []
        for sample in samples:
            try:
                transformed.append(transform(sample))
            except DecodeError as exc:  # a sample the transform cannot decode (``DecodeImages``): skipped, counted
                self._skip(exc)
        return transformed

    def _open(self, segment: int) -> SegmentReader | None:
        """This process's reader of a segment, or None where it does not open (``CorruptRecordError``: each of its
        records is skipped when read)."""
        try:
            return self._reader(segment)
        except CorruptRecordError:
            return None

    def record_bytes(self, index: int) -> int:
        """The length of sample ``index``'s record, unchecked (a hint: ``SegmentReader.length``); 0 where its segment
        does not open."""
        segment, record = self.locate([index])
        reader = self._open(int(segment[0]))
        return 0 if reader is None else reader.length(int(record[0]))

    def iter_items(self, indices: Sequence[int], *, tensors: bool = True) -> Iterator[Any]:
        """``__getitems__`` one sample at a time: each record is read (and verified) when the next is asked for,
        so a worker can copy it into its batch while its bytes are still in the CPU's cache (``RowCollator``).

        ``tensors=False`` (and no transform): arrays stay the reader's numpy arrays, for a caller that copies them
        into a batch itself and would only turn each tensor back into an array (``as_tensors`` makes the sample
        ``__getitems__`` would have yielded). With a transform, the transform gets tensors as always."""
        segments, records = self.locate(indices)
        readers = self._readers if self._pid == os.getpid() else {}  # forked: ``_reader`` reopens our own
        for segment, record in zip(segments.tolist(), records.tolist(), strict=True):
            try:
                reader = readers.get(segment)
                if reader is None:
                    reader = self._reader(segment)  # a segment failing at open: each of its records is skipped
                    readers = self._readers
                sample = self._read(reader, segment, record, tensors=tensors)
            except (CorruptRecordError, DecodeError) as exc:  # DecodeError: the transform's (``DecodeImages``)
                self._skip(exc)
                continue
            yield sample

    def _skip(self, exc: CorruptRecordError | DecodeError) -> None:
        self._count_skip()
        what = "a sample its transform cannot decode" if isinstance(exc, DecodeError) else "a corrupt record"
        log.warning("skipping %s in snapshot %s: %s", what, self.snap_id, exc)

    def _count_skip(self) -> None:
        info = get_worker_info()
        slot = 0 if info is None else 1 + info.id % (COUNTER_SLOTS - 1)
        self.skip_counter.add(slot)

    def close(self) -> None:
        """Close this process's readers (arrays still alive keep their maps) and remove the counter file."""
        readers, self._readers = self._readers, {}
        if self._pid == os.getpid():
            for reader in readers.values():
                _OPEN.release(reader)
        self.skip_counter.close()
