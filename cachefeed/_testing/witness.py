"""A witness of cachefeed's read promises that does not trust its ledger.

Two records, both taken outside the code under test:

* ``SegmentWitness`` watches a cache's ``segments/`` from another thread: every segment file that appears is opened
  and its samples' keys are read *from the file* (records verified); a file that disappears has been evicted. No
  counter, receipt or ledger of the daemon is read. ``held_twice`` lists each key that two segments held in one
  listing of the directory: the cache held that sample twice.
* ``Served`` is what the user's loop received: the keys of every batch, epoch by epoch, as the loop saw them.

``check_promises`` then asserts, for one configuration: no key served twice within an epoch; every key the loop
received came from a witnessed segment (the witness missed nothing that was served); every evicted key was served
in at least ``k`` epochs; and status's "evicted unread" equals the witness's count of evicted keys never served.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachefeed._cache.records import SegmentReader
from cachefeed._testing.daemon import DaemonProcess


def identity(key: Any, url: Any = None) -> str:
    """A sample's identity: its ``__key__`` (relative to its source) with the object's ``__url__`` when it has one."""
    return str(key) if url is None else f"{url}::{key}"


def sample_keys(batch: Mapping[str, Any]) -> list[str]:
    """The identities of a batch's samples, as the loop received them (``__key__`` and ``__url__``)."""
    urls = batch.get("__url__")
    if urls is None:
        return [identity(key) for key in batch["__key__"]]
    return [identity(key, url) for key, url in zip(batch["__key__"], urls, strict=True)]


class SegmentWitness:
    """Reads the keys of every segment the daemon publishes, and notes which ones it evicts (module docstring)."""

    def __init__(self, cache_dir: Path, *, poll_s: float = 0.003) -> None:
        self.segments_dir = cache_dir / "segments"
        self.poll_s = poll_s
        self.keys: dict[str, list[str]] = {}  # segment name -> keys of its samples, read from the file
        self.evicted: set[str] = set()
        self.unreadable: list[str] = []  # published and gone before the witness could open it
        self.held_twice: list[tuple[str, str, str]] = []  # (key, segment, segment): both in one listing of segments/
        self._holder: dict[str, str] = {}  # key -> the present segment that holds it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="witness", daemon=True)

    def __enter__(self) -> SegmentWitness:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Take one last look and stop watching."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._look()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            time.sleep(self.poll_s)

    def _look(self) -> None:
        try:
            present = {name for name in os.listdir(self.segments_dir) if name.endswith(".seg")}
        except FileNotFoundError:
            return
        gone = (self.keys.keys() - self.evicted) - present
        for name in gone:
            for key in self.keys[name]:
                if self._holder.get(key) == name:
                    del self._holder[key]
        self.evicted |= gone
        for name in sorted(present - self.keys.keys()):
            try:
                with SegmentReader(self.segments_dir / name) as reader:
                    samples = (reader.read(i) for i in range(len(reader)))
                    self.keys[name] = [identity(s["__key__"], s.get("__url__")) for s in samples]
            except FileNotFoundError:
                self.unreadable.append(name)
                continue
            for key in self.keys[name]:
                other = self._holder.setdefault(key, name)
                if other != name:  # both files were in this one listing: the cache held the sample twice
                    self.held_twice.append((key, other, name))

    def evicted_keys(self) -> list[str]:
        return [key for name in sorted(self.evicted) for key in self.keys[name]]

    def repeated_keys(self) -> int:
        """Keys cached in more than one segment (fetched again in a later pass over the remote)."""
        cached = Counter(key for keys in self.keys.values() for key in keys)
        return sum(1 for n in cached.values() if n > 1)

    def all_keys(self) -> set[str]:
        return {key for keys in self.keys.values() for key in keys}


@dataclass
class Served:
    """What the user's loop received, epoch by epoch."""

    epochs: list[list[str]] = field(default_factory=list)

    def epoch(self, keys: Iterable[str]) -> None:
        self.epochs.append(list(keys))

    def times(self) -> Counter[str]:
        """In how many epochs each key was served."""
        counts: Counter[str] = Counter()
        for keys in self.epochs:
            counts.update(set(keys))
        return counts


def check_promises(
    witness: SegmentWitness, served: Served, status: Mapping[str, Any], *, k: int = 1, repeats_allowed: bool = False
) -> dict[str, int]:
    """Assert the read promises for one run (module docstring); returns the figures, for messages."""
    assert not witness.unreadable, f"segments evicted before the witness read them: {witness.unreadable[:5]}"
    assert not witness.repeated_keys(), "a key was cached twice: the run must not pass over its remote twice"
    if not repeats_allowed:
        for number, keys in enumerate(served.epochs):
            repeated = [key for key, n in Counter(keys).items() if n > 1]
            assert not repeated, f"epoch {number} served {len(repeated)} keys twice, e.g. {repeated[:3]}"
    times = served.times()
    unknown = set(times) - witness.all_keys()
    assert not unknown, f"the loop received keys no witnessed segment held: {sorted(unknown)[:3]}"
    evicted = witness.evicted_keys()
    under = [key for key in evicted if times[key] < k]
    never = [key for key in evicted if times[key] == 0]
    assert not under, (
        f"{len(under)} of {len(evicted)} evicted samples were served fewer than {k} times "
        f"({len(never)} never), e.g. {under[:3]}"
    )
    reported = status["evicted"]["unread_samples_total"]
    assert reported == len(never), f"status says {reported} evicted unread, the witness saw {len(never)}"
    return {"evicted": len(evicted), "served_distinct": len(times), "never_served_evicted": len(never)}


def final_status(daemon: DaemonProcess, epochs: int) -> dict[str, Any]:
    """Once every epoch's receipt is applied: stop the daemon and read the last status it wrote (nothing is
    evicted after it)."""
    daemon.wait_status(lambda d: d["cache"]["epochs_total"] >= epochs, timeout_s=60, what=f"{epochs} receipts")
    assert daemon.stop() == 0, daemon.stderr()
    document: dict[str, Any] = json.loads((daemon.cache_dir / "status.json").read_text())
    assert document["state"] == "stopped", document["state"]
    assert document["cache"]["epochs_total"] == epochs, "every epoch counted once"
    return document
