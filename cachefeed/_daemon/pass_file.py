"""The pass file: how far each source's current pass got, so that a restarted daemon goes on with that pass.

A pass visits every owned object once, in a seeded order (``plan.py``). The restart catalog keeps which objects
there are, and the recovered segments which of them are cached, but not which of them the pass had visited: a
restarted daemon began pass 0 again, in the same order, and fetched first the objects it had fetched in that pass
and evicted since (their samples read already), ahead of those it had never fetched; ``passes_completed`` went back
to 0. This file keeps the pass: a restarted daemon goes on with it and draws none of its visited objects again.

One file per source: ``<cache.dir>/pass-<tag>.cfpass`` (``CacheLayout.pass_file``; metadata in the budget, as
the restart catalog is). Layout (little-endian)::

    b"CFPASS\\x00\\x01"  u32 n  header JSON (n bytes): {"format", "identity", "pass", "passes_completed"}
    then the records, appended, one per object resolved in the pass:  u8 kind (1 drawn, 2 skipped, 3 again)
                                                                       u64 its path's ``columns.key_hash``

Contract:

* **Written by the supervisor's loop alone** (``PassFileWriter``). Each pass starts the file again: the header
  alone, replaced atomically. The objects the plan resolves in the pass (``SamplingPlan.take_resolved``) are
  appended and flushed at each upkeep (every 0.5 s) and when the daemon stops. A daemon killed loses at most the
  last half second's records: those objects are fetched again in the pass, as every object was before this file.
  A torn last record is ignored.
* **Resolved** means drawn no more in the pass: drawn and done (cached, or holding no samples) or failed, or
  skipped (cached already, dropped, quarantined, or no longer listed). An object in flight is not resolved: a
  restart draws it again, and so does a fetch that a stop cut short. Whether any record says drawn decides whether
  the resumed pass is counted in ``passes_completed`` when it ends (``plan.py``, "Counted passes").
* **Read once, at start, before any listing page** (``read_pass_file``). A file whose ``identity`` differs from
  the config's (the seed, and the source's ``made_with`` record: URL, pattern, decoder, node share...) is not
  used: the cache's samples of the old settings were evicted, and a pass of another seed visits objects in
  another order. A damaged file is not used either (a warning says why). Then the plan continues pass ``pass``
  with ``passes_completed`` and draws none of the recorded objects in it (``SamplingPlan.resume_pass``), and the
  file is started again with what it held (``PassFileWriter.carry``): a second restart in the same pass knows
  what the first one's records held.
* **Bounded**: records stop at ``MAX_SHARE`` of ``cache.max_bytes``, shared equally by the sources' files (9
  bytes an object: a pass over a million objects takes 9 MB); what the pass resolves past that is fetched again
  after a restart (one warning says so).
* **Queued again**: an object the pass resolved and then queued again (its new version listed, or it was in a
  segment retired for the remote's changes: ``plan.py``, "Retired samples") gets a record of kind 3. An object
  is resolved where its last record is of kind 1 or 2: one queued again and not resolved since is drawn again
  after a restart. Each save writes its kinds 1 and 2 before its 3s: an object queued again and resolved within
  one save is fetched once more after a restart rather than never.
"""

from __future__ import annotations

import errno
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from cachefeed._errors import CachefeedError
from cachefeed._fsutil import atomic_write
from cachefeed._logs import get_logger

__all__ = ["MAX_SHARE", "PassFileError", "PassFileWriter", "PassState", "read_pass_file"]

log = get_logger(__name__)

MAGIC = b"CFPASS\x00\x01"
FORMAT_VERSION = 1
MAX_SHARE = 0.05  # of cache.max_bytes: the most a pass file's records take
_U32 = struct.Struct("<I")
_RECORD = np.dtype([("kind", "u1"), ("key", "<u8")])  # packed: 9 bytes
_DRAWN, _SKIPPED, _AGAIN = 1, 2, 3
_Keys = Sequence[int] | npt.NDArray[np.uint64]


class PassFileError(CachefeedError):
    """A pass file that cannot be read (another format, a damaged header)."""


@dataclass(frozen=True, slots=True)
class PassState:
    """What a pass file kept: the pass, the passes completed before it, and the objects resolved in it."""

    pass_index: int
    passes_completed: int
    resolved: npt.NDArray[np.uint64]  # key hashes, sorted, each once
    drew: bool  # the pass had drawn objects


def _canonical(identity: dict[str, Any]) -> Any:
    """``identity`` as it reads back from JSON (tuples as lists), for comparing with a file's."""
    return json.loads(json.dumps(identity))


def read_pass_file(path: Path, identity: dict[str, Any]) -> PassState | None:
    """The pass kept at ``path`` if it was written under ``identity``; None where there is no file or it was written
    under another. Raises ``PassFileError`` if the file is damaged."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if not data:
        raise PassFileError("the file is empty")
    if not data.startswith(MAGIC):
        raise PassFileError("not a cachefeed pass file (or another format version)")
    start = len(MAGIC) + _U32.size
    if len(data) < start:
        raise PassFileError("the header is truncated")
    (n,) = _U32.unpack_from(data, len(MAGIC))
    try:
        doc = json.loads(data[start : start + n])
        if doc["format"] != FORMAT_VERSION:
            raise PassFileError(f"format {doc['format']!r}, expected {FORMAT_VERSION}")
        is_ours = doc["identity"] == _canonical(identity)
        state = (int(doc["pass"]), int(doc["passes_completed"]))
    except (ValueError, KeyError, TypeError) as exc:  # JSON or its fields
        raise PassFileError(f"the header is damaged ({type(exc).__name__}: {exc})") from None
    if not is_ours:
        return None
    body = data[start + n :]
    records = np.frombuffer(body, _RECORD, count=len(body) // _RECORD.itemsize)  # a torn last record: ignored
    if len(records) and not np.isin(records["kind"], (_DRAWN, _SKIPPED, _AGAIN)).all():
        raise PassFileError("a record is damaged (an unknown kind)")
    latest = records[::-1]  # each key's last record decides: np.unique takes a key's first in this order
    keys, first = np.unique(latest["key"].astype(np.uint64), return_index=True)
    resolved = keys[latest["kind"][first] != _AGAIN]
    return PassState(state[0], state[1], resolved, bool((records["kind"] == _DRAWN).any()))


class PassFileWriter:
    """Keeps one source's pass at ``path`` (see the module docstring): ``save`` after each upkeep, ``close`` at
    the end. Main loop only."""

    def __init__(self, path: Path, identity: dict[str, Any], *, mode: int, max_bytes: int) -> None:
        self.path = path
        self._identity = identity
        self._mode = mode
        self._max_records = max(0, max_bytes // _RECORD.itemsize)
        self._pass: int | None = None  # the pass the file holds
        self._records = 0
        self._out: IO[bytes] | None = None
        self._is_full = False  # said once per pass
        self._is_failing = False  # said once until a save succeeds

    def carry(self, state: PassState) -> None:
        """Start the file with what an earlier run kept (read under the same identity), before this run's saves:
        header and records in one atomic write, so that a crash leaves the earlier file or this one, whole."""
        keys = state.resolved
        drawn, skipped = (keys, ()) if state.drew else ((), keys)
        try:
            self._start(state.pass_index, state.passes_completed, _records(drawn, skipped))
        except OSError as exc:
            self._fail(exc)
        else:
            self._is_failing = False

    def save(self, pass_index: int, passes_completed: int, drawn: _Keys, skipped: _Keys, again: _Keys = ()) -> None:
        """Record that ``drawn`` and ``skipped`` (key hashes) were resolved in pass ``pass_index``, and ``again``
        queued again in it (module docstring, "Queued again"); a new pass
        starts the file again. A write that fails is logged (once until one succeeds) and the file removed, so
        that a restart would begin the pass again, as with no file; the next save starts the file again, without
        what it lost."""
        try:
            if pass_index != self._pass:
                self._start(pass_index, passes_completed)
            if (len(drawn) or len(skipped) or len(again)) and self._pass is not None:
                self._append(_records(drawn, skipped, again))
        except OSError as exc:
            self._fail(exc)
        else:
            self._is_failing = False

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None

    def _start(self, pass_index: int, passes_completed: int, first: npt.NDArray[Any] | None = None) -> None:
        """Replace the file by one of pass ``pass_index``, holding ``first`` (records) at once."""
        self.close()
        self._pass, self._records, self._is_full = None, 0, False
        header = json.dumps(
            {
                "format": FORMAT_VERSION,
                "identity": self._identity,
                "pass": pass_index,
                "passes_completed": passes_completed,
            },
            separators=(",", ":"),
        ).encode()
        kept = self._room_for(first if first is not None else np.empty(0, _RECORD), pass_index)
        atomic_write(self.path, MAGIC + _U32.pack(len(header)) + header + kept.tobytes(), mode=self._mode)
        self._out = self.path.open("ab")
        self._pass, self._records = pass_index, len(kept)

    def _append(self, records: npt.NDArray[Any]) -> None:
        assert self._out is not None
        kept = self._room_for(records, self._pass)
        if len(kept):
            self._out.write(kept.tobytes())
            self._out.flush()
            self._records += len(kept)

    def _room_for(self, records: npt.NDArray[Any], pass_index: int | None) -> npt.NDArray[Any]:
        """Those of ``records`` the file has room for (``max_bytes``); where it has not, said once per pass. Records
        of objects queued again are kept before the others: left out, an earlier record would say resolved, and a
        restart would skip the object for the rest of the pass. Where even they do not fit, ``OSError`` (the file
        is removed, ``_fail``: a restart begins the pass again)."""
        room = self._max_records - self._records
        if len(records) <= room:
            return records
        again = records["kind"] == _AGAIN
        if int(np.count_nonzero(again)) > room:
            raise OSError(errno.EFBIG, "its share of cache.max_bytes cannot hold the objects queued again in the pass")
        if not self._is_full:
            self._is_full = True
            log.warning(
                "the pass file %s reached its share of %.0f%% of cache.max_bytes: objects resolved from now on in "
                "pass %s are fetched again in it if the daemon restarts",
                self.path,
                MAX_SHARE * 100,
                pass_index,
            )
        others = records[~again]
        return np.concatenate([others[: room - int(np.count_nonzero(again))], records[again]])

    def _fail(self, exc: OSError) -> None:
        if not self._is_failing:
            log.warning("cannot keep the pass file %s (%s): a restart would begin this pass again", self.path, exc)
        self._is_failing = True
        self.close()
        self._pass = None  # the next save starts the file again
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass


def _records(drawn: _Keys, skipped: _Keys, again: _Keys = ()) -> npt.NDArray[Any]:
    """The records of ``drawn``, ``skipped`` and ``again`` key hashes, in that order."""
    records = np.empty(len(drawn) + len(skipped) + len(again), _RECORD)
    at = 0
    for kind, keys in ((_DRAWN, drawn), (_SKIPPED, skipped), (_AGAIN, again)):
        records["kind"][at : at + len(keys)] = kind
        records["key"][at : at + len(keys)] = keys
        at += len(keys)
    return records
