"""Feeding a launch-bound model on a GPU (issue 14): ResNet-18's images/s fed by cachefeed, next to its ceiling.

    python -m benchmarks.feed_gpu [--samples 8192,16384] [--workers 8] [--steps 200] [--repeats 3] [--daemon]
    python -m benchmarks.feed_gpu --device cpu --model tiny --samples 256 --batch 16 --workers 2 --steps 8 \\
        --repeats 1 --no-save        # the same code path on a CPU, for a smoke test (tests/test_benchmarks_smoke.py)

``python -m benchmarks.feed`` runs it after the GIL-bound proxy whenever CUDA is present. The model is torchvision's
ResNet-18 (``--model tiny``: a small convnet, for machines without torchvision), trained with SGD under bf16
autocast in ``channels_last``, on batches of ``--batch`` (256; several sizes, comma-separated, are measured in
turn, each with loaders of its own) samples of a 3 x 224 x 224 uint8 image (150,528 bytes) and an int label,
converted to float on the device. A smaller batch makes the step shorter and the training thread busier launching
kernels: the per-batch cost of the data path shows more. Each system is timed over ``--steps`` steps after
``--warmup`` steps, the device synchronised at both ends; the figures are images/s (the median of ``--repeats``
runs, the systems measured in turn within each repeat), its ratio to the ceiling's median, and the ratio paired by
repeat (each run against the ceiling's run of the same repeat, the median over repeats: a launch-bound loop's speed
drifts by 20-30% within a minute, so at small batches many short repeats, ``--steps 40 --repeats 10``, say more
than a few long ones):

* ``ceiling``: one batch already on the device, reused every step (what the model does when data costs nothing);
* ``plain DataLoader``: the images in one uint8 tensor in RAM (``__getitems__``), ``--workers`` persistent fork
  workers, ``pin_memory=True``, ``DevicePrefetcher``;
* ``cachefeed, N samples``: ``EpochLoaderFactory`` over a static cache of N samples on tmpfs (``--dir``),
  ``--workers`` workers, ``pin_memory=True`` (the workers' shared memory registered as pinned), every record
  verified, ``DevicePrefetcher``; epochs handed over as in training;
* ``cachefeed + daemon`` (``--daemon``): the daemon ingests from a ``file://`` remote of twice the largest cache's
  samples into a cache budgeted for it, with the sampling contract's pacing (``evict_after_reads = 1``), while the
  trainer reads; the row also gives what the daemon ingested and evicted unread over all the runs. Every other
  row starts once the daemon fetches nothing again (``settled``), so no other row pays for its ingest.

What a run needs, printed before it starts and checked against the machine (it exits with the figures and what
to change rather than fail half-way): under ``--dir`` (``/dev/shm`` by default) the static caches, and with
``--daemon`` its ``file://`` remote of twice the largest cache plus the daemon's cache (about 11 GB with the
defaults; a container's ``/dev/shm`` is 64 MB unless the runtime is told otherwise: pass ``--dir`` on a disk or a
larger tmpfs, or fewer ``--samples``); and the workers' shared memory: every cachefeed row keeps its factory, so
its ``--workers`` workers, alive while its batch size is measured (the rows are measured in turn within each
repeat), each with a 256 MiB arena that CUDA page-locks whole (3 factories x 8 workers x 256 MiB = 6 GiB pinned
with the defaults; more than half of ``MemAvailable`` is refused).

Every loader drops its last partial batch: the daemon's snapshots change size every epoch, and under
``cudnn.benchmark`` each new batch shape would be tuned anew inside the timed window.

Writes ``benchmarks/results/feed_gpu.json`` (``--no-save`` to skip). The issue's target: cachefeed at 0.95 of the
ceiling or better. ``scripts/gpu_checks.sh`` runs it on a GPU machine after the tests marked ``gpu``; the README
renders the committed result (``readme_table``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.common.results import provenance_line, save
from benchmarks.common.static_cache import write_static_cache
from cachefeed import DevicePrefetcher, EpochLoaderFactory
from cachefeed._testing.daemon import DaemonProcess, start_daemon, write_config
from cachefeed._trainer.pool import ARENA_BYTES

IMAGE_SHAPE = (3, 224, 224)
CLASSES = 10
SEGMENT_BYTES = 64 << 20


SAMPLE_BYTES = int(np.prod(IMAGE_SHAPE)) + 1024  # one image and its label, as a record or an .npz, with headroom


def footprint(sizes: list[int], workers: int, daemon: bool) -> tuple[int, int]:
    """(bytes written under --dir, bytes of the workers' arenas while every row's factory is alive)."""
    disk = sum(sizes) * SAMPLE_BYTES + (3 * max(sizes) * SAMPLE_BYTES if daemon else 0)  # remote 2x + its cache 1x
    arenas = (len(sizes) + int(daemon)) * workers * ARENA_BYTES
    return disk, arenas


def check_machine(where: Path, disk: int, arenas: int, *, pinned: bool) -> None:
    """Exit with what the run needs and what to change when ``where`` or the memory cannot hold it."""
    free = shutil.disk_usage(where).free
    if disk > free:
        raise SystemExit(
            f"--dir {where}: this run writes about {disk / 1e9:.1f} GB there but {free / 1e9:.1f} GB are free "
            "(a container's /dev/shm is 64 MB unless enlarged): pass --dir on a disk or a larger tmpfs, or fewer "
            "--samples"
        )
    if pinned:
        available = next(
            int(line.split()[1]) << 10 for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemAvailable:")
        )  # fmt: skip
        if arenas > available // 2:
            raise SystemExit(
                f"the workers' arenas, pinned whole, take {arenas / 2**30:.1f} GiB (rows x --workers x "
                f"{ARENA_BYTES >> 20} MiB) of {available / 2**30:.1f} GiB available: fewer --workers or --samples"
            )


def make_model(name: str) -> nn.Module:
    """ResNet-18 from torchvision, or a small convnet (``tiny``) where torchvision is not installed."""
    if name == "resnet18":
        import torchvision  # optional: only a GPU machine is expected to have it

        return torchvision.models.resnet18(num_classes=CLASSES)
    if name == "tiny":
        return nn.Sequential(
            nn.Conv2d(3, 8, 7, stride=8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES)
        )  # fmt: skip
    raise SystemExit(f"--model: {name!r} is not one of resnet18, tiny")


class Trainer:
    """One model, optimiser and step; ``run(batches, steps, warmup)`` gives images/s."""

    def __init__(self, model: str, device: torch.device) -> None:
        self.device = device
        self.model = make_model(model).to(device, memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            x = images.contiguous(memory_format=torch.channels_last).float().div_(255)
            loss = nn.functional.cross_entropy(self.model(x), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, batches: Iterator[dict[str, torch.Tensor]], steps: int, warmup: int) -> float:
        images = 0
        for _ in range(warmup):
            batch = next(batches)
            self.step(batch["image"], batch["label"])
        self._sync()
        started = time.perf_counter()
        for _ in range(steps):
            batch = next(batches)
            if tuple(batch["image"].shape[1:]) != IMAGE_SHAPE or batch["image"].device.type != self.device.type:
                raise AssertionError(f"unexpected batch: {tuple(batch['image'].shape)} on {batch['image'].device}")
            self.step(batch["image"], batch["label"])
            images += len(batch["label"])
        self._sync()
        return images / (time.perf_counter() - started)


def image_samples(count: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """``count`` samples of random pixels (a few distinct images, offset per sample) and a label."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(IMAGE_SHAPE))
    pool = rng.integers(0, 256, size=size + 4096, dtype=np.uint8)
    for i in range(count):
        start = (i * 64) % 4096
        yield {"__key__": f"s{i}", "image": pool[start : start + size].reshape(IMAGE_SHAPE), "label": i % CLASSES}


class InMemoryImages(Dataset[dict[str, Any]]):
    """The plain DataLoader's data: every image a row of one uint8 tensor in RAM, fetched a batch at a time."""

    def __init__(self, count: int) -> None:
        self.images = torch.randint(0, 256, (count, *IMAGE_SHAPE), dtype=torch.uint8)
        self.labels = torch.arange(count) % CLASSES

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index], "label": self.labels[index]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{"image": i, "label": lab} for i, lab in zip(self.images[indices], self.labels[indices], strict=True)]


def forever(epoch_batches: Callable[[int], Any], device: torch.device) -> Iterator[Any]:
    """Batches on ``device``, epoch after epoch: ``epoch_batches(epoch)`` is the loader of each."""
    epoch = 0
    while True:
        yield from DevicePrefetcher(epoch_batches(epoch), device)
        epoch += 1


def write_remote(root: Path, count: int) -> None:
    """A ``file://`` remote of ``count`` .npz objects (one ``image`` array each) in ``CLASSES`` class directories,
    so that the daemon's ``label = "parent"`` gives the same ``label`` as the static caches' samples."""
    for sample in image_samples(count, seed=1):
        directory = root / f"class{sample['label']}"
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / f"{sample['__key__']}.npz", image=sample["image"])


def start_ingesting(
    work: Path, remote_count: int, cache_samples: int, samplers: int, wait_s: float
) -> tuple[DaemonProcess, Path]:
    """The daemon over a file:// remote, budgeted for about ``cache_samples``, with ``samplers`` sampler processes;
    returns once its cache is full."""
    remote, cache_dir = work / "remote", work / "daemon-cache"
    write_remote(remote, remote_count)
    budget = cache_samples * (int(np.prod(IMAGE_SHAPE)) + 1024)
    segment_bytes = min(16 << 20, budget // 16)  # the daemon wants room for 2 x processes segments in writing
    config = write_config(
        work / "daemon.toml",
        endpoint="",
        bucket="",
        cache_dir=cache_dir,
        sections={
            "remote": {"url": f"file://{remote}", "storage_options": {}, "pattern": "**/*.npz"},
            "cache": {"max_bytes": budget, "segment_bytes": segment_bytes, "snapshot_grace": "10s"},
            "sampler": {"processes": samplers, "decode": "npz", "label": "parent"},
        },
    )
    daemon = start_daemon(config, cache_dir, work / "daemon.stderr")
    print(f"  daemon: filling its cache with about {cache_samples} samples", flush=True)
    settled(daemon, timeout_s=wait_s)
    return daemon, cache_dir


def settled(daemon: DaemonProcess, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """The first status the daemon writes from now on that says it fetches nothing: its cache is full and paced
    (waiting for reads) or backpressured (the rest is pinned by the snapshots of the paused daemon row's factory).
    Every other system is then measured with the daemon idle, not catching up on the last row's reads, and the
    counters read after the last row include all the ingest that row caused."""
    now = time.time()

    def idle(status: dict[str, Any]) -> bool:
        return status["updated_at"] >= now and bool(status["cache"]["is_paced"] or status["cache"]["is_backpressured"])

    return daemon.wait_status(idle, timeout_s=timeout_s, what="a daemon with nothing to fetch")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; returns the figures (also written to ``feed_gpu.json`` unless ``--no-save``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="resnet18", help="resnet18 (torchvision) or tiny")
    parser.add_argument("--samples", default="8192,16384", help="static cache sizes (samples), comma-separated")
    parser.add_argument("--batch", default="256", help="batch sizes, comma-separated: each is measured in turn")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--daemon", action="store_true", help="also measure while the daemon ingests (file://)")
    parser.add_argument("--daemon-samplers", type=int, default=4, help="the daemon's sampler processes")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (use --device cpu --model tiny for a smoke run)")
    torch.backends.cudnn.benchmark = True
    pinned = device.type == "cuda"  # pinned host memory: the DataLoader's pin thread, cachefeed's registered arenas
    sizes = [int(x) for x in args.samples.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    disk, arenas = footprint(sizes, args.workers, args.daemon)
    print(
        f"needs about {disk / 1e9:.1f} GB under {args.dir} and {arenas / 2**30:.1f} GiB of worker arenas"
        f"{' (pinned)' if pinned else ''}",
        flush=True,
    )
    check_machine(args.dir, disk, arenas, pinned=pinned)
    work = Path(tempfile.mkdtemp(prefix="cachefeed-feed-gpu-", dir=args.dir))
    trainer = Trainer(args.model, device)
    runs: dict[tuple[int, str], list[float]] = {}
    extra: dict[str, Any] = {}

    def measure_batch_size(batch: int, daemon: DaemonProcess | None, cache_dir: Path | None) -> None:
        """Every row at one batch size, ``--repeats`` times, into ``runs``: its loaders (and their workers' pinned
        arenas) live only while it runs."""
        with ExitStack() as loaders:

            def fed_by_cachefeed(root: Path) -> Iterator[Any]:
                factory = EpochLoaderFactory(
                    root, batch_size=batch, drop_last=True, num_workers=args.workers, pin_memory=pinned, progress=None
                )
                return forever(loaders.enter_context(factory).loader, device)

            systems: dict[str, Iterator[Any]] = {}
            first = next(iter(DataLoader(InMemoryImages(batch), batch_size=batch)))
            ceiling = {key: value.to(device) for key, value in first.items()}
            systems["ceiling"] = iter(lambda: ceiling, None)
            plain = DataLoader(
                InMemoryImages(max(sizes)),
                batch_size=batch,
                shuffle=True,
                drop_last=True,
                num_workers=args.workers,
                persistent_workers=True,
                pin_memory=pinned,
            )
            systems["plain DataLoader"] = forever(lambda _epoch: plain, device)
            for samples in sizes:
                systems[f"cachefeed, {samples} samples"] = fed_by_cachefeed(work / f"cache-{samples}")
            if cache_dir is not None:
                systems["cachefeed + daemon"] = fed_by_cachefeed(cache_dir)
            for repeat in range(args.repeats):
                for name, batches_of in systems.items():
                    if daemon is not None and name != "cachefeed + daemon":
                        settled(daemon)
                    rate = trainer.run(batches_of, args.steps, args.warmup)
                    runs.setdefault((batch, name), []).append(rate)
                    print(f"  batch {batch}, run {repeat + 1}: {name:<28} {rate:9.0f} images/s", flush=True)

    try:
        with ExitStack() as stack:
            for samples in sizes:
                write_static_cache(
                    work / f"cache-{samples}",
                    image_samples(samples),
                    segment_bytes=SEGMENT_BYTES,
                    max_bytes=samples << 20,
                )
            daemon, before, cache_dir = None, None, None
            if args.daemon:
                daemon, cache_dir = start_ingesting(work, 2 * max(sizes), max(sizes), args.daemon_samplers, wait_s=600)
                stack.callback(daemon.stop)
                before = settled(daemon)
            for batch in batches:
                measure_batch_size(batch, daemon, cache_dir)
            if daemon is not None and before is not None:
                after = settled(daemon)
                extra["daemon"] = {
                    "samplers": args.daemon_samplers,
                    "ingested_samples": after["ingest"]["samples_total"] - before["ingest"]["samples_total"],
                    "evicted_unread_samples": after["evicted"]["unread_samples_total"]
                    - before["evicted"]["unread_samples_total"],
                    "cached_samples": after["cache"]["samples"],
                }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for (batch, name), rates in runs.items():
        ceilings = runs[batch, "ceiling"]
        rate, top = statistics.median(rates), statistics.median(ceilings)
        # Each run against the ceiling's run of the same repeat, a few seconds apart: a launch-bound loop's speed
        # drifts by 20-30% within a minute on a shared host, and the pairing takes that drift out of the ratio.
        paired = statistics.median(run / ceiling for run, ceiling in zip(rates, ceilings, strict=True))
        rows.append(
            {
                "batch": batch,
                "system": name,
                "images_per_s": round(rate),
                "of_ceiling": round(rate / top, 3),
                "of_ceiling_paired": round(paired, 3),
                "runs": rates,
            }
        )
        print(
            f"batch {batch:<4} {name:<28} {rate:9.0f} images/s  {rate / top:5.2f} of the ceiling, "
            f"{paired:5.2f} paired by repeat"
        )
    if extra:
        print(f"while the daemon ran: {extra['daemon']}")
    figures = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "batches": batches,
        "workers": args.workers,
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
        **extra,
    }
    if not args.no_save:
        print(f"wrote {save('feed_gpu', figures, work_dir=args.dir)}")
    return figures


def readme_table(doc: dict[str, Any]) -> str:
    """The README's GPU feed table, from a committed result document."""
    figures = doc["figures"]
    batches = figures["batches"]
    paired = all("of_ceiling_paired" in r for r in figures["rows"])
    fraction = (
        "the fraction of the ceiling (each run against the ceiling's run of the same repeat, the median over "
        "the repeats)"
        if paired
        else "the fraction of the ceiling at the same batch size"
    )
    lines = [
        f"ResNet-18 trained on {figures['device']} (bf16 autocast, `channels_last`, 3 x 224 x 224 uint8 images), "
        f"{figures['workers']} workers, pinned memory; images/s (the median of {figures['repeats']} runs of "
        f"{figures['steps']} steps, the systems in turn within each repeat) and {fraction}:",
        "",
        "| fed by | " + " | ".join(f"batch {b}" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    shown = {
        "ceiling": "ceiling: one batch already on the GPU, every step",
        "plain DataLoader": "plain DataLoader over a tensor in RAM (`pin_memory=True`)",
        "cachefeed + daemon": "cachefeed while the daemon ingests (`evict_after_reads = 1`)",
    }
    cells: dict[str, dict[int, str]] = {}
    for r in figures["rows"]:
        share = r["of_ceiling_paired"] if paired else r["of_ceiling"]
        cells.setdefault(r["system"], {})[r["batch"]] = f"{r['images_per_s']:,} ({share:.2f})"
    for system, by_batch in cells.items():
        name = shown.get(system, system.replace(" samples", " samples (a static cache)"))
        lines.append(f"| {name} | " + " | ".join(by_batch.get(b, "-") for b in batches) + " |")
    daemon = figures.get("daemon")
    if daemon:
        lines += [
            "",
            f"While the daemon rows ran, the daemon ({daemon.get('samplers', 4)} sampler processes) ingested "
            f"{daemon['ingested_samples']:,} samples from its `file://` remote (its status's counters; "
            f"{daemon['cached_samples']:,} cached at the end).",
        ]
    lines += ["", "Measured with " + provenance_line(doc) + f", on {figures['device']}."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
