"""``cachefeed demo``: the whole system end to end, with no set-up.

What it does, in order (each long wait shows progress on stderr):

1. starts a local S3 endpoint on 127.0.0.1 (moto's server, from the ``demo`` extra) — or uses ``--remote``;
2. uploads a generated dataset: ``--objects`` samples of a 4-class problem (``x``: float32 features, ``y``: the
   class), one ``.npz`` object each; or with ``--images``, JPEGs of mixed sizes in one directory per class
   (``train/<class>/<n>.jpg``), which the daemon decodes, resizes to 32 x 32 and labels by directory;
3. starts ``cachefeed daemon`` with a cache budget of ``--budget`` (a fraction of the dataset), so eviction and
   turnover happen while training runs;
4. trains a small linear classifier for ``--epochs`` epochs through ``EpochLoaderFactory``, one line per epoch:
   samples cached (the epoch's snapshot), new since the last epoch, evicted so far, the handover wait,
   samples/s and the loss;
5. prints ``cachefeed status`` and stops everything it started (the daemon with SIGTERM, the S3 server), removing
   its temporary directory unless ``--keep``.

``--remote s3://bucket/prefix`` (with ``--storage-option KEY=VALUE``) or ``--remote file:///dir`` runs the same
loop over your data: a real bucket, or a local directory (``--local-dir DIR`` writes the generated dataset there and
uses it as the remote, with no S3 server at all).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from cachefeed._config import toml_text
from cachefeed._errors import CachefeedError, ConfigError, UsageError
from cachefeed._scrub import safe_url
from cachefeed._testing.local_s3 import DUMMY_ENV, LocalS3

__all__ = ["add_arguments", "run"]

CLASSES = 4
FEATURES = 2048  # 8 KiB of float32 per sample
BUCKET = "cachefeed-demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=5, help="epochs to train (default 5)")
    parser.add_argument("--objects", type=int, default=2000, help="generated dataset size in samples (2000)")
    parser.add_argument("--budget", type=float, default=0.35, help="cache budget as a fraction of the dataset (0.35)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per batch (64)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (2)")
    parser.add_argument("--remote", metavar="URL", help="train on this remote instead (s3://..., file:///...)")
    parser.add_argument("--pattern", default="**", help="glob under --remote (default **)")
    parser.add_argument(
        "--decode", default="npy", help="decoder for --remote objects (default npy, as the daemon's sampler.decode)"
    )
    parser.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE", help="for --remote (repeatable)"
    )
    parser.add_argument("--local-dir", metavar="DIR", help="generate the dataset in DIR and use it as the remote")
    parser.add_argument("--cache-dir", metavar="DIR", help="cache directory (default: a temporary one)")
    parser.add_argument(
        "--max-bytes",
        metavar="SIZE",
        help='cache budget, e.g. "2GiB" (default: --budget of the generated dataset; with --remote, whose size the '
        "demo does not know, 5 MiB)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (cache, logs)")
    parser.add_argument(
        "--images",
        action="store_true",
        help="a folder of JPEGs in class directories instead, decoded and labelled by the daemon (needs Pillow)",
    )


def _say(text: str, *, out: TextIO = sys.stderr, end: str = "\n") -> None:
    out.write(text + end)
    out.flush()


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    started = time.monotonic()
    _say(f"{what} ...", end="")
    yield
    _say(f" done ({time.monotonic() - started:.1f}s)")


def _make_dataset(count: int, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """(key, npz bytes) pairs of a learnable 4-class problem: class templates plus noise."""
    rng = np.random.default_rng(seed)
    templates = rng.normal(0.0, 1.0, size=(CLASSES, FEATURES)).astype(np.float32)
    for i in range(count):
        label = int(rng.integers(CLASSES))
        features = templates[label] + rng.normal(0.0, 3.0, size=FEATURES).astype(np.float32)
        buffer = io.BytesIO()
        np.savez(buffer, x=features, y=np.int64(label))
        yield f"train/{i // 1000:03d}/{i:06d}.npz", buffer.getvalue()


IMAGE_SIZE = 32
IMAGE_CLASSES = ("circle", "cross", "square", "stripes")


def _make_images(count: int, seed: int = 0) -> Iterator[tuple[str, bytes]]:
    """(key, JPEG bytes) pairs: ``train/<class>/<n>.jpg``, sizes from 40 to 96 pixels, a class-coloured tint plus
    noise, so that a linear model on the decoded pixels learns the class."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    tints = np.array([(200, 60, 60), (60, 200, 60), (60, 60, 200), (200, 200, 60)], dtype=np.float32)
    for i in range(count):
        label = int(rng.integers(len(IMAGE_CLASSES)))
        height, width = (int(n) for n in rng.integers(40, 97, size=2))
        pixels = np.clip(tints[label] + rng.normal(0, 40, size=(height, width, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
        yield f"train/{IMAGE_CLASSES[label]}/{i:06d}.jpg", buffer.getvalue()


def _upload(server: LocalS3, items: Iterator[tuple[str, bytes]], count: int) -> int:
    """Put the generated objects into the demo bucket, with progress; returns their bytes."""
    client = server.client()
    client.create_bucket(Bucket=BUCKET)
    total = done = 0
    started = time.monotonic()
    prefix, end = ("\r", "") if sys.stderr.isatty() else ("", "\n")
    with ThreadPoolExecutor(8) as pool:
        futures = []
        for key, body in items:
            total += len(body)
            futures.append(pool.submit(client.put_object, Bucket=BUCKET, Key=key, Body=body))
        for future in futures:
            future.result()
            done += 1
            if done % 500 == 0 or done == count:
                rate = done / max(time.monotonic() - started, 1e-9)
                _say(f"{prefix}  uploading to {server.endpoint}: {done}/{count} objects ({rate:.0f}/s)", end=end)
    if end == "":
        _say("")
    return total


def _write_local(directory: Path, items: Iterator[tuple[str, bytes]]) -> int:
    total = 0
    for key, body in items:
        path = directory / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
        total += len(body)
    return total


def _write_config(path: Path, sections: dict[str, dict[str, Any]]) -> None:
    path.write_text(toml_text(sections))


def _status_document(cache_dir: Path) -> dict[str, Any] | None:
    from cachefeed._errors import StatusUnreadable
    from cachefeed._status.document import load_document

    try:
        return load_document(cache_dir / "status.json")
    except StatusUnreadable:
        return None


def _wait_running(daemon: subprocess.Popen[bytes], cache_dir: Path, log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        document = _status_document(cache_dir)
        if document is not None and document["state"] in ("running", "degraded"):
            return
        if daemon.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-15:]
            raise CachefeedError("the daemon exited during start-up:\n" + "\n".join(tail))
        if time.monotonic() > deadline:
            raise CachefeedError(f"the daemon did not become ready in 120 s; see {log_path}")
        time.sleep(0.1)


def _check_listed(
    cache_dir: Path, args: argparse.Namespace, log_path: Path, timeout_s: float = 60.0, first_s: float = 10.0
) -> None:
    """A ``--remote`` that lists no objects (a typo in the URL or the pattern), or none of whose objects can be
    cached within ``first_s`` of the listing (a wrong ``--decode``, say), is a usage error now, naming the daemon's
    reason, rather than a trainer that waits minutes for samples that never come. A listing that fails or takes
    longer, and a remote slow to deliver its first objects, are left to the trainer's wait, whose progress line
    names the daemon's reason."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        document = _status_document(cache_dir)
        listing = None if document is None else document["remote"]
        if listing is not None and listing["last_listed_at"]:
            listed = int(listing["objects_listed"])
            if listed == 0:
                raise UsageError(
                    f"--remote {safe_url(args.remote)!r} lists no objects matching --pattern {args.pattern!r}: check "
                    "the URL and the pattern"
                )
            if document is not None and document["cache"]["samples"]:
                return
            deadline = min(deadline, time.monotonic() + first_s)
            refused = listing.get("not_cached") or {}
            if sum(refused.values()) >= listed:
                reasons = ", ".join(f"{kind}: {count}" for kind, count in sorted(refused.items()))
                first = next((line for line in _log_lines(log_path) if "quarantined" in line), "")
                raise UsageError(
                    f"none of the {listed} objects --remote lists can be cached ({reasons})"
                    + (f"; the first: {first.split(': ', 1)[-1]}" if first else "")
                    + (f"; is --decode {args.decode!r} right for them?" if "decode" in refused else "")
                )
        time.sleep(0.1)


def _log_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _wait_for_reads(cache_dir: Path, epochs: int, timeout_s: float = 10.0) -> None:
    """Give the daemon a moment to apply the last epochs' read receipts (at most twice a second) before the
    status is shown, so it counts every epoch the demo read."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        document = _status_document(cache_dir)
        if document is not None and document["cache"]["epochs_total"] >= epochs:
            return
        time.sleep(0.1)


def _parse_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r}: expected KEY=VALUE")
        options[key] = value
    return options


def _check_options(args: argparse.Namespace) -> None:
    """The options that reach the daemon's config or the loader, checked before anything is written or started:
    a mistake is named by its option, not by the key of a temporary config file, and exits 64 (a usage error)."""
    from cachefeed._config import fields

    if args.remote:
        from fsspec import get_filesystem_class
        from fsspec.utils import get_protocol

        try:
            get_filesystem_class(get_protocol(args.remote))
        except (ValueError, ImportError) as exc:
            raise UsageError(f"--remote = {safe_url(args.remote)!r}: {exc}") from None
    if args.workers < 0:
        raise UsageError(f"--workers = {args.workers}: expected an integer >= 0 (0: read in the training process)")
    checks: list[tuple[str, object, Callable[[object], object]]] = [
        ("--decode", args.decode, fields.decoder),
        ("--pattern", args.pattern, fields.nonempty_string),
    ]
    if args.max_bytes:
        checks.append(("--max-bytes", args.max_bytes, fields.positive_size))
    for option, value, check in checks:
        try:
            check(value)
        except ValueError as exc:
            raise UsageError(f"{option} = {value!r}: {exc}") from None
    from cachefeed._codecs import BUILTIN_DECODERS, get_decoder

    if args.decode not in BUILTIN_DECODERS:
        try:
            get_decoder(args.decode)
        except ConfigError as exc:
            raise UsageError(f"--decode = {args.decode!r}: {str(exc).removeprefix(f'{args.decode!r}: ')}") from None


def run(args: argparse.Namespace) -> int:
    for name in ("epochs", "objects", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} = {getattr(args, name)}: expected an integer >= 1")
    if not 0.05 <= args.budget <= 1.0:
        raise UsageError(f"--budget = {args.budget}: expected a fraction between 0.05 and 1")
    _check_options(args)
    storage_options: dict[str, Any] = _parse_options(args.storage_option)
    # `timeout`, `kill`, a closed terminal: clean up as Ctrl-C does (the handlers are put back at the end)
    previous = {signum: signal.signal(signum, _exit_on_signal) for signum in _STOP_SIGNALS}
    workdir = Path(tempfile.mkdtemp(prefix="cachefeed-demo-"))
    server: LocalS3 | None = None
    daemon: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    try:
        make_dataset = _make_images if args.images else _make_dataset
        generated_decode = "image" if args.images else "npz"
        if args.images:
            from cachefeed._images import require_pillow

            require_pillow()
        if args.remote:
            url, decode = args.remote, args.decode
            dataset_bytes = 0
        elif args.local_dir:
            local = Path(args.local_dir).resolve()
            with _step(f"writing {args.objects} samples to {local}"):
                dataset_bytes = _write_local(local, make_dataset(args.objects))
            url, decode = local.as_uri(), generated_decode
        else:
            with _step("starting a local S3 server (moto) on 127.0.0.1"):
                server = LocalS3.start(log_path=workdir / "s3-server.log")
            os.environ.update(DUMMY_ENV)  # the daemon (our child) talks to that server: never to your AWS account
            dataset_bytes = _upload(server, make_dataset(args.objects), args.objects)
            url, decode = f"s3://{BUCKET}/train", generated_decode
            storage_options = server.storage_options()
        segment_bytes = 256 << 10
        if args.images:  # the cache holds decoded pixels: size the budget by them, not by the JPEGs
            dataset_bytes = args.objects * (3 * IMAGE_SIZE * IMAGE_SIZE + 200)
        if args.max_bytes:
            max_bytes: int | str = args.max_bytes
        else:
            # the budget's floor: the metadata reserve (1 MiB) plus enough segments to train on and turn over
            max_bytes = max(int(dataset_bytes * args.budget) + (1 << 20), 16 * segment_bytes + (1 << 20))
        cache_dir = Path(args.cache_dir).resolve() if args.cache_dir else workdir / "cache"
        config_path = workdir / "cachefeed.toml"
        _write_config(
            config_path,
            {
                "remote": {
                    "url": url,
                    "pattern": args.pattern,
                    "storage_options": storage_options,
                    "refresh_interval": "30s",
                    "read_timeout": "10s",
                },
                "cache": {
                    "dir": str(cache_dir),
                    "max_bytes": max_bytes,
                    "min_free_bytes": "0",
                    "segment_bytes": segment_bytes,
                    "turnover": "30%",
                    "fsync": False,
                },
                "sampler": {
                    "processes": 1,
                    "concurrency": 16,
                    "decode": decode,
                    **({"image_size": IMAGE_SIZE, "label": "parent"} if args.images and not args.remote else {}),
                },
                "status": {"interval": "500ms"},
            },
        )
        log_path = workdir / "daemon.log"
        with _step(f"starting the cache daemon (budget {max_bytes} bytes, log {log_path})"), log_path.open("wb") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "cachefeed", "daemon", "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            _wait_running(daemon, cache_dir, log_path)
        if args.remote:
            _check_listed(cache_dir, args, log_path)
        _train(args, cache_dir)
        _wait_for_reads(cache_dir, args.epochs)
        from cachefeed._status.render import render_human
        from cachefeed._status.report import read_report

        _say("\n$ cachefeed status --cache-dir " + str(cache_dir), out=sys.stdout)
        _say(render_human(read_report(cache_dir)), out=sys.stdout)
        _say(f"demo finished in {time.monotonic() - started:.0f}s", out=sys.stdout)
        return 0
    finally:
        for signum in _STOP_SIGNALS:  # a second signal must not cut the cleanup short: the daemon would outlive us
            signal.signal(signum, signal.SIG_IGN)
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        if server is not None:
            server.stop()
        if args.keep:
            _say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(signum: int, _frame: object) -> None:
    """SIGTERM or SIGHUP: leave through ``run``'s ``finally``, which stops the daemon and the S3 server (each in a
    session of its own, which the signal does not reach) and removes the demo's files."""
    raise SystemExit(128 + signum)


def _features_and_labels(batch: dict[str, Any]) -> tuple[Any, Any]:
    """The generated datasets' inputs and targets: ``x``/``y`` (npz) or ``image``/``label`` (``--images``)."""
    if "x" in batch and "y" in batch:
        return batch["x"].reshape(len(batch["x"]), -1).float(), batch["y"]
    if "image" in batch and "label" in batch:
        return batch["image"].reshape(len(batch["image"]), -1).float() / 255, batch["label"]
    return None, None


def _train(args: argparse.Namespace, cache_dir: Path) -> None:
    import torch

    from cachefeed._trainer.loader import EpochLoaderFactory

    torch.manual_seed(0)
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    evicted_before = 0
    header = f"{'epoch':>5} {'cached':>7} {'new':>6} {'evicted':>8} {'handover':>9} {'samples/s':>10} {'loss':>7}"
    with EpochLoaderFactory(
        cache_dir,
        batch_size=args.batch_size,
        num_workers=args.workers,  # the first epoch starts on the first segments and grows as they arrive
        wait_timeout_s=300,
        epochs=args.epochs,
        run_id="demo",
    ) as factory:
        for epoch in range(args.epochs):
            loader = factory.loader(epoch)
            if epoch == 0:
                _say(header, out=sys.stdout)
            seen, loss_sum, batches = 0, 0.0, 0
            epoch_started = time.monotonic()
            if epoch == 0 and factory.classes:
                _say(f"classes (from the whole listing): {', '.join(factory.classes)}", out=sys.stdout)
            for batch in loader:
                features, labels = _features_and_labels(batch)
                if features is None or labels is None:
                    seen += len(batch["__key__"])
                    continue
                if model is None:
                    model = torch.nn.Linear(features.shape[1], max(CLASSES, len(factory.classes)))
                    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                assert optimizer is not None
                loss = torch.nn.functional.cross_entropy(model(features), labels.long())
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                loss_sum += loss.detach().item()
                batches += 1
                seen += len(features)
            elapsed = time.monotonic() - epoch_started
            stats = factory.stats(epoch)
            document = _status_document(cache_dir) or {}
            evicted = int(document.get("evicted", {}).get("samples_total", evicted_before))
            handover = "-" if stats.handover_wait_s is None else f"{stats.handover_wait_s * 1000:.1f} ms"
            loss_text = f"{loss_sum / batches:.3f}" if batches else "-"
            _say(
                f"{epoch:>5} {stats.samples:>7} {stats.new_samples:>6} {evicted:>8} {handover:>9} "
                f"{seen / max(elapsed, 1e-9):>10.0f} {loss_text:>7}",
                out=sys.stdout,
            )
            evicted_before = evicted
