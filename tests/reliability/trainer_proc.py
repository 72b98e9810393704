"""A trainer process for the reliability suite: read every sample of every epoch and verify it against its key.

    python -m tests.reliability.trainer_proc CACHE_DIR --run-id ID [--mode factory|dataset|hold|hold-raw]
        [--workers N] [--batch B] [--version V ...] [--max-epochs E] [--step-s S] [--min-epoch-s S]

* ``factory``: ``EpochLoaderFactory`` (DataLoader workers if ``--workers``), epoch after epoch.
* ``dataset``: ``Snapshot.create`` + ``SnapshotDataset.__getitems__`` in batches, epoch after epoch.
* ``hold``: pin epoch 0 through ``EpochLoaderFactory`` (workers started, first batch read), print
  ``pinned <snapshot id>`` and sleep until killed (its DataLoader workers are its children).
* ``hold-raw``: ``Snapshot.create`` only, print ``pinned <id>``, sleep until killed.

Until SIGTERM (or ``--max-epochs``): then it prints one JSON line of counts (``epochs``, ``verified``, ``wrong``
with the first problems, ``errors`` (exceptions, each printed to stderr), ``skipped`` corrupt records, ``distinct``
keys, ``empty_epochs``) and exits. Every epoch that raised is retried with a fresh factory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from cachefeed._cache.snapshots import Snapshot
from cachefeed._trainer import EpochLoaderFactory, SnapshotDataset
from tests.reliability.common import sample_path, sample_problem


class Stopped(Exception):
    """SIGTERM arrived."""


def _on_term(signum: int, frame: object) -> None:
    raise Stopped


def as_list(batch: list[Any]) -> list[Any]:
    """Collate into a plain list: samples of different sizes stay apart (module level: picklable)."""
    return batch


class Counts:
    def __init__(self, versions: tuple[str, ...]) -> None:
        self.versions = versions
        self.epochs = 0
        self.empty_epochs = 0
        self.verified = 0
        self.wrong = 0
        self.errors = 0
        self.skipped = 0
        self.problems: list[str] = []
        self.keys: set[str] = set()

    def check(self, sample: dict[str, Any]) -> None:
        problem = sample_problem(sample, self.versions)
        if problem is None:
            self.verified += 1
            self.keys.add(str(sample_path(sample)))
        else:
            self.wrong += 1
            if len(self.problems) < 10:
                self.problems.append(problem)

    def error(self) -> None:
        self.errors += 1
        traceback.print_exc()

    def as_json(self) -> str:
        return json.dumps(
            {
                "epochs": self.epochs,
                "empty_epochs": self.empty_epochs,
                "verified": self.verified,
                "wrong": self.wrong,
                "errors": self.errors,
                "skipped": self.skipped,
                "distinct": len(self.keys),
                "problems": self.problems,
            }
        )


def run_factory(args: argparse.Namespace, counts: Counts) -> None:
    options: dict[str, Any] = {"multiprocessing_context": "fork"} if args.workers else {}
    epoch = 0
    while args.max_epochs is None or epoch < args.max_epochs:
        try:
            with EpochLoaderFactory(
                args.cache_dir,
                batch_size=args.batch,
                num_workers=args.workers,
                collate_fn=as_list,
                run_id=f"{args.run_id}-{os.getpid()}",
                min_samples=1,
                progress=None,
                **options,
            ) as factory:
                while args.max_epochs is None or epoch < args.max_epochs:
                    began = time.monotonic()
                    loader = factory.loader(epoch)
                    served = 0
                    for batch in loader:
                        for sample in batch:
                            counts.check(sample)
                            served += 1
                        time.sleep(args.step_s)  # the training step
                    counts.skipped += factory.stats(epoch).skipped_corrupt
                    counts.epochs += 1
                    epoch += 1
                    counts.empty_epochs += served == 0
                    time.sleep(max(0.0, args.min_epoch_s - (time.monotonic() - began)))
        except Stopped:
            raise
        except Exception:
            counts.error()
            epoch += 1
            time.sleep(0.2)


def run_dataset(args: argparse.Namespace, counts: Counts) -> None:
    epoch = 0
    while args.max_epochs is None or epoch < args.max_epochs:
        began = time.monotonic()
        try:
            with Snapshot.create(args.cache_dir, f"{args.run_id}-{os.getpid()}-d{epoch}") as snapshot:
                dataset = SnapshotDataset.from_snapshot(snapshot)
                try:
                    for start in range(0, len(dataset), args.batch):
                        for sample in dataset.__getitems__(list(range(start, min(start + args.batch, len(dataset))))):
                            counts.check(sample)
                        time.sleep(args.step_s)  # the training step
                    counts.skipped += dataset.skipped
                finally:
                    dataset.close()
            counts.epochs += 1
            counts.empty_epochs += snapshot.samples == 0
            time.sleep(max(0.0, args.min_epoch_s - (time.monotonic() - began)))
        except Stopped:
            raise
        except Exception:
            counts.error()
            time.sleep(0.2)
        epoch += 1


def hold(args: argparse.Namespace) -> None:
    if args.mode == "hold-raw":
        snapshot = Snapshot.create(args.cache_dir, f"{args.run_id}-{os.getpid()}")
        print(f"pinned {snapshot.snap_id}", flush=True)
    else:
        options: dict[str, Any] = {"multiprocessing_context": "fork"} if args.workers else {}
        factory = EpochLoaderFactory(
            args.cache_dir,
            batch_size=args.batch,
            num_workers=args.workers,
            collate_fn=as_list,
            run_id=f"{args.run_id}-{os.getpid()}",
            min_samples=1,
            progress=None,
            **options,
        )
        loader = factory.loader(0)
        next(iter(loader))
        print(f"pinned {loader.snapshot_id}", flush=True)
    while True:
        time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache_dir")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--mode", choices=("factory", "dataset", "hold", "hold-raw"), default="factory")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--version", action="append", default=None)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--step-s", type=float, default=0.005, help="sleep per batch, standing for a training step")
    parser.add_argument("--min-epoch-s", type=float, default=0.1, help="an epoch lasts at least this long")
    args = parser.parse_args()
    if args.mode.startswith("hold"):
        hold(args)
        return
    counts = Counts(tuple(args.version or [""]))
    signal.signal(signal.SIGTERM, _on_term)
    print("started", flush=True)
    try:
        (run_factory if args.mode == "factory" else run_dataset)(args, counts)
    except Stopped:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(counts.as_json(), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the counts are out; do not wait on a factory interrupted mid-epoch


if __name__ == "__main__":
    main()
