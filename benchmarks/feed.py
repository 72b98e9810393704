"""Feeding a busy training loop: what the batch path costs a training thread that holds the GIL.

    python -m benchmarks.feed [--step-ms 4,8,16] [--samples 1536,4096] [--steps 300] [--block 20] [--repeats 5]
                              [--workers 2] [--gpu auto|only|no]

Where CUDA is present (``--gpu auto``, the default), it then runs the ResNet-18 case of the issue in a process of
its own: ``python -m benchmarks.feed_gpu --daemon`` (images/s fed by cachefeed against the model's GPU-resident
ceiling and a plain DataLoader; see that module). ``--gpu only`` runs just that, ``--gpu no`` just the proxy below.

An eager model on a fast GPU keeps its training thread in Python (kernel launches) most of the time; any per-batch
Python on that process (receiving the batch, rebuilding shared memory, helper threads that need the GIL) is paid by
the accelerator. The proxy here is a training step that is a pure-Python loop holding the GIL for ``--step-ms``,
fed ``--batch`` x 128 KiB uint8 samples per step by ``--workers`` DataLoader workers, in one run:

* ``data-free``: the step alone (the ceiling, steps/s), in blocks of ``--block`` steps alternating with the fed
  blocks of the same run (``interleaved``: both rates see the same drift of this shared machine);
* ``cachefeed``: ``EpochLoaderFactory`` over a static cache of ``--samples`` samples on tmpfs, shuffled, verified,
  epochs handed over as in training (``len`` = samples / batch batches an epoch);
* ``plain DataLoader``: a batched in-memory dataset (one uint8 tensor in RAM, ``__getitems__``), persistent
  workers, shuffled: what a DataLoader costs when storage costs nothing.

Each fed run reports steps/s and its ratio to the data-free rate (the median of ``--repeats`` runs), for each step
length and cache size. Writes ``benchmarks/results/feed.json`` (``--no-save`` to skip).

Where the training thread's time went (8 ms steps, 32 x 128 KiB batches, 2 workers, 1,536 samples, this 2-core
machine; ``time.perf_counter`` around ``next()`` and cProfile, 300 steps):

* before (a DataLoader per epoch, commit 73a01f4): ``next()`` took 1.5 ms (median; mean 2.6 ms) per batch. Most of
  it was receiving the batch's shared memory: each batch is a fresh shared-memory file whose descriptor the
  training process fetches from the worker through ``multiprocessing.resource_sharer`` (a socket connection, an
  HMAC handshake, ``recvmsg``: about 1 ms), then rebuilds the storage (``torch.empty``, ``set_``, ``mmap``) and
  later unmaps it; the DataLoader's ``record_function`` added about 0.1 ms. Per epoch, two workers were forked
  (on the build thread, which then competes for the GIL) and mapped and faulted in the snapshot's pages again.
  Fed rate: 0.67 of data-free (the plain DataLoader, which pays the same per-batch transfer: 0.51).
* after (``_trainer/pool.py``): ``next()`` takes 0.33-0.44 ms (median): 0.10 ms to receive the batch's layout (a
  few hundred bytes), 0.12 ms to rebuild it as views of the worker's shared memory, the rest to hand the next
  batch to a worker. Workers live across epochs and keep shared segments mapped: 1.2 ms of worker CPU per 4 MiB
  batch (read, checksum, stack). Nothing is forked at an epoch boundary; the next epoch's build (pin, index) runs
  on the build thread in a few ms of Python.
* then (one-off profiles of 2026-11-23, 2 workers, 8 ms steps): most of what was left was not Python but the
  scheduler. cProfile of ``next()`` under load: the pipe ``write`` that hands a worker its next task took 0.46-0.75 s
  per 300 batches, because the worker it woke preempted the training thread on its core; with the workers under
  ``SCHED_BATCH`` (``cachefeed/_sched.py``) 0.01-0.19 s. The batch's layout now crosses as a skeleton id and its
  leaves, and the training process builds the batch with a skeleton compiled once (a numpy array and
  ``torch.from_numpy`` per tensor): 16 us in a tight loop, about 0.3 ms after 8 ms of other Python (cold caches;
  the mean of ``next()`` by position in the epoch over 10 epochs). Per-record reads in the workers cost a third of
  what they did (format 4, ``benchmarks/record_cost.py``).
* then (one-off, 2026-11-23, 1,536 samples, 12-20 epochs, each fed epoch followed by as many data-free steps; the
  training thread's CPU time from ``/proc/self/task/<tid>/schedstat`` and ``stat``): the fed epochs took 21-45 ms
  more than the data-free ones, about 0.3 ms of it in each ``next()``; the rest was the busy steps themselves,
  0.5 ms (7%) longer in *user* CPU time when fed. No page faults, no system time, no TLB or call IPIs on the training
  thread's core (``/proc/interrupts``); not the GIL (a thread waking every 4 ms for a syscall, 173 GIL handoffs in
  288 steps, cost nothing measurable); not the caches ``next()`` itself leaves (+0.01 ms); the build and teardown
  threads use 7-8 ms of CPU an epoch. It followed the workers' memory traffic: a worker verified all 32 records of
  a batch (xxh3 reads every byte) and then stacked them, so 4 MiB crossed memory twice and had left the cache by the
  copy. Now each large sample is copied into its batch right after its checksum (``RowCollator`` in
  ``cachefeed/_trainer/collate.py``; 3.5-4.2 GB/s -> 5.3-5.5 GB/s for checksum and copy on one core): the committed run
  (b18e824) gives 0.98 at 1,536 samples and 0.97 at 4,096 at 8 ms steps, 0.92 at 4 ms, where it gave 0.88 / 0.95
  and 0.81 / 0.93. Why the traffic slowed a thread that touches none of it is not proven (this VM exposes no
  hardware counters to ``perf``; the cores share one 8 MiB L3).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common.results import provenance_line, save
from benchmarks.read_throughput import build_cache
from cachefeed._trainer import EpochLoaderFactory

SAMPLE_BYTES = 128 << 10


def busy_step(iterations: int) -> None:
    """A training step that holds the GIL: a fixed amount of pure-Python work (a stand-in for launching kernels).

    Fixed work, not a deadline: time another thread of this process takes from it (the GIL) makes the step longer,
    as it makes a real step's launches later."""
    total = 0
    for i in range(iterations):
        total += i


def calibrate(seconds: float) -> int:
    """Iterations of ``busy_step`` that take ``seconds`` on this machine with nothing else running."""
    iterations = 10_000
    while True:
        started = time.perf_counter()
        busy_step(iterations)
        took = time.perf_counter() - started
        if took > 0.05:
            return max(1, round(iterations * seconds / took))
        iterations *= 2


def interleaved(batches: Iterator[Any], steps: int, step: int, warmup: int, block: int) -> tuple[float, float]:
    """(fed steps/s, data-free steps/s), measured in alternating blocks of ``block`` steps: fed, then the same
    number of steps without data, until ``steps`` of each ran.

    Why interleaved: the speed of a pure-Python loop on a shared machine drifts by 10-20% within a minute (other
    tenants, frequency), more than the effect measured; a data-free rate taken once, before or after, moves the
    ratio by as much. Short alternating blocks expose both rates to the same drift. The workers keep at most
    ``prefetch_factor`` batches each ready, so a data-free block starts with them refilling a few batches, on the
    other core, then idle."""
    for _ in range(warmup):
        next(batches)
        busy_step(step)
    fed_s = free_s = 0.0
    done = 0
    while done < steps:
        count = min(block, steps - done)
        started = time.perf_counter()
        for _ in range(count):
            batch = next(batches)
            if batch["data"].shape[1] != SAMPLE_BYTES:
                raise AssertionError(f"unexpected batch shape {tuple(batch['data'].shape)}")
            busy_step(step)
        fed_s += time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(count):
            busy_step(step)
        free_s += time.perf_counter() - started
        done += count
    return steps / fed_s, steps / free_s


def cachefeed_batches(factory: EpochLoaderFactory) -> Iterator[Any]:
    epoch = 0
    while True:
        yield from factory.loader(epoch)
        epoch += 1


class InMemory(Dataset[dict[str, Any]]):
    """The DataLoader's own ceiling: samples are rows of one tensor in RAM, fetched a batch at a time."""

    def __init__(self, samples: int) -> None:
        self.data = torch.randint(0, 256, (samples, SAMPLE_BYTES), dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"data": self.data[index]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{"data": row} for row in self.data[indices]]


def plain_batches(samples: int, batch: int, workers: int) -> Iterator[Any]:
    loader = DataLoader(InMemory(samples), batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=True)
    while True:
        yield from loader


def measure(system: str, work: Path, samples: int, step_ms: float, args: argparse.Namespace) -> tuple[float, float]:
    """(fed steps/s, data-free steps/s measured just before it): a ratio taken in one stretch of one run."""
    step = calibrate(step_ms / 1000)
    if system == "cachefeed":
        with EpochLoaderFactory(
            work / f"cache-{samples}", batch_size=args.batch, num_workers=args.workers, progress=None
        ) as factory:
            return interleaved(cachefeed_batches(factory), args.steps, step, args.warmup, args.block)
    return interleaved(plain_batches(samples, args.batch, args.workers), args.steps, step, args.warmup, args.block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", default="4,8,16", help="training step lengths to try, comma-separated")
    parser.add_argument("--samples", default="1536,4096", help="cache sizes (samples) to try, comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--block", type=int, default=20, help="steps per block; fed and data-free blocks alternate")
    parser.add_argument("--repeats", type=int, default=5, help="the median of this many runs is reported")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--gpu", choices=("auto", "only", "no"), default="auto", help="ResNet-18 (auto: with CUDA)")
    args = parser.parse_args()
    if args.gpu != "no" and torch.cuda.is_available():
        gpu_argv = [sys.executable, "-m", "benchmarks.feed_gpu", "--daemon", "--dir", str(args.dir)]
        subprocess.run(gpu_argv + (["--no-save"] if args.no_save else []), check=True)
    elif args.gpu == "only":
        raise SystemExit("--gpu only: CUDA is not available here")
    if args.gpu == "only":
        return
    steps_ms = [float(x) for x in args.step_ms.split(",")]
    sizes = [int(x) for x in args.samples.split(",")]
    work = Path(tempfile.mkdtemp(prefix="cachefeed-feed-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        for samples in sizes:
            build_cache(work / f"cache-{samples}", SAMPLE_BYTES, samples * SAMPLE_BYTES)
            for step_ms in steps_ms:
                for system in ("cachefeed", "plain DataLoader"):
                    runs = [measure(system, work, samples, step_ms, args) for _ in range(args.repeats)]
                    ratios = sorted(rate / ceiling for rate, ceiling in runs)
                    row = {
                        "system": system,
                        "samples": samples,
                        "step_ms": step_ms,
                        "steps_per_s": round(statistics.median(rate for rate, _ in runs), 1),
                        "data_free_steps_per_s": round(statistics.median(c for _, c in runs), 1),
                        "of_data_free": round(statistics.median(ratios), 3),
                        "of_data_free_runs": [round(r, 3) for r in ratios],
                    }
                    rows.append(row)
                    print(
                        f"{samples:>6} samples  {step_ms:4g} ms steps  {system:<17} {row['steps_per_s']:7.1f} steps/s"
                        f"  {row['of_data_free']:5.2f} of data-free  (runs {row['of_data_free_runs']})",
                        flush=True,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = {
        "batch": args.batch,
        "sample_bytes": SAMPLE_BYTES,
        "workers": args.workers,
        "steps": args.steps,
        "block": args.block,
        "repeats": args.repeats,
        "rows": rows,
    }
    if not args.no_save:
        path = save("feed", figures, work_dir=args.dir)
        print(f"wrote {path}")


def readme_table(doc: dict[str, Any]) -> str:
    """The README's feed table, from a committed result document."""
    figures = doc["figures"]
    rows = figures["rows"]
    ratio = {(r["samples"], r["step_ms"], r["system"]): r["of_data_free"] for r in rows}
    lines = [
        f"Steps per second of a training step that holds the GIL (a pure-Python loop), as a fraction of the same "
        f"loop without data; {figures['batch']} x {figures['sample_bytes'] >> 10} KiB batches, "
        f"{figures['workers']} workers, median of {figures['repeats']} runs of {figures['steps']} steps:",
        "",
        "| cache | step | cachefeed | plain DataLoader over a tensor in RAM, persistent workers |",
        "|---|---|---|---|",
    ]
    for samples, step_ms in dict.fromkeys((r["samples"], r["step_ms"]) for r in rows):
        cells = [ratio.get((samples, step_ms, system)) for system in ("cachefeed", "plain DataLoader")]
        lines.append(
            f"| {samples:,} samples | {step_ms:g} ms | "
            + " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
            + " |"
        )
    lines += ["", "Measured with " + provenance_line(doc) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
