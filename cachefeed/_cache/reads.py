"""Epoch reads: the receipts trainers leave and the daemon's ledger of how many epochs read each segment.

The contract between the daemon and its trainers is reads, not time: a segment may be evicted only once
``cache.evict_after_reads`` epochs have read it (``_cache/store.py``). This module owns how a read is reported and
remembered; both sides import it.

NOTE [ Read receipts ]
----------------------
Processes: trainer ranks (any number per snapshot) mark, the last holder of a snapshot writes the receipt (or the
daemon's sweep, when that holder died), the daemon consumes it.

* A trainer that has read an epoch over snapshot ``<id>`` (served at least one batch of it) creates
  ``snapshots/<id>/READ`` before it releases its pin (``Snapshot.mark_read``). Every rank may; a second create
  is a no-op.
* Whoever removes the snapshot directory (see NOTE [ Snapshot pinning protocol ]) first looks for ``READ``; if it
  is there, it writes ``snapshots/<id>.<token>.receipt`` atomically: the segment names of the snapshot's MANIFEST.
  So one receipt per snapshot however many ranks shared it, and a snapshot nobody read (the job ended before the
  epoch began) leaves none. The token is random: snapshot ids repeat across runs (``<run_id>-e<epoch>``).
  While no daemon holds the cache's writer lock (a static cache, written once and read for ever; or a daemon
  restarting), no receipt is written: nobody would collect it, and receipts would pile up one per epoch. The
  reads missed count as fewer reads, which only keeps data longer.
* The daemon (``ReadLedger``) reads every receipt, credits one read to each named segment it still publishes,
  writes its ledger ``reads`` (counts per segment name and the names of the receipts it just applied) atomically,
  and only then unlinks the receipts. After a crash between the two steps, a receipt named in the ledger is
  unlinked without being counted again: every epoch counts exactly once, however short, and counts survive a
  restart. A segment the ledger does not name counts as unread: a lost or corrupt ledger makes the daemon keep
  data longer, never evict it early.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgpack

from cachefeed._fsutil import atomic_write
from cachefeed._logs import get_logger

__all__ = ["LEDGER_NAME", "READ_MARK", "RECEIPT_SUFFIX", "ReadLedger", "Receipt", "read_counts", "write_receipt"]

log = get_logger(__name__)

READ_MARK = "READ"
RECEIPT_SUFFIX = ".receipt"
LEDGER_NAME = "reads"
_LEDGER_VERSION = 1


@dataclass(frozen=True, slots=True)
class Receipt:
    """One epoch's read of one snapshot, as the daemon finds it in ``snapshots/``."""

    name: str  # the receipt's file name
    snap_id: str
    segments: tuple[str, ...]


def write_receipt(snapshots: Path, snap_id: str, segments: Iterable[str], *, mode: int = 0o640) -> None:
    """Leave the receipt of one epoch read of ``snap_id`` (its segment names) for the daemon."""
    document = {"snapshot": snap_id, "segments": list(segments), "at": time.time()}
    name = f"{snap_id}.{secrets.token_hex(6)}{RECEIPT_SUFFIX}"
    atomic_write(snapshots / name, msgpack.packb(document), mode=mode)


def read_counts(root: Path) -> dict[str, int]:
    """The ledger's counts per segment name, for readers (trainers): empty if there is none or it is unreadable."""
    try:
        document = msgpack.unpackb((root / LEDGER_NAME).read_bytes(), raw=False)
        return {str(name): int(n) for name, n in document["counts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


class ReadLedger:
    """The daemon's side: collects receipts and keeps the counts in ``<root>/reads`` (the single writer)."""

    def __init__(self, root: Path, snapshots: Path, *, file_mode: int = 0o640) -> None:
        self.path = root / LEDGER_NAME
        self._snapshots = snapshots
        self._file_mode = file_mode
        self._applied: frozenset[str] = frozenset()
        self.epochs_total = 0

    def load(self) -> dict[str, int]:
        """The counts per segment name as last committed (empty if there is no ledger or it cannot be read)."""
        try:
            document = msgpack.unpackb(self.path.read_bytes(), raw=False)
            if not isinstance(document, dict) or document.get("version") != _LEDGER_VERSION:
                raise ValueError("not a ledger of this version")
            counts = {str(name): int(n) for name, n in document["counts"].items()}
            self._applied = frozenset(str(name) for name in document["applied"])
            self.epochs_total = int(document["epochs_total"])
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
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
            try:
                if not entry.is_file(follow_symlinks=False):
                    raise ValueError("not a regular file")
                document = msgpack.unpackb(Path(entry.path).read_bytes(), raw=False)
                receipt = Receipt(entry.name, str(document["snapshot"]), tuple(str(n) for n in document["segments"]))
                receipts.append((float(document.get("at", 0.0)), receipt))
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("removing an unreadable read receipt %s (%s)", entry.name, exc)
                Path(entry.path).unlink(missing_ok=True)
        return [receipt for _at, receipt in sorted(receipts, key=lambda pair: pair[0])]

    def commit(self, applied: list[Receipt], counts: Mapping[str, int]) -> None:
        """Persist ``counts`` (after ``applied`` was credited), then remove the applied receipts."""
        self.epochs_total += len(applied)
        names = frozenset(receipt.name for receipt in applied)
        document = {
            "version": _LEDGER_VERSION,
            "counts": dict(counts),
            "applied": sorted(names),
            "epochs_total": self.epochs_total,
        }
        atomic_write(self.path, msgpack.packb(document), mode=self._file_mode)
        self._applied = names
        for receipt in applied:
            (self._snapshots / receipt.name).unlink(missing_ok=True)
