"""A fresh process that reads a cache with ``pin_memory=True`` and copies every batch to ``cuda:<device>`` while the
current device stays 0 (DDP without ``torch.cuda.set_device``); prints what the GPU tests of NOTE [ Pinned arenas ]
check, as JSON: which devices have a context before and after, whether batches were pinned, whether every copy
arrived intact. Run: ``python -m tests.support.pinned_contexts CACHE_DIR DEVICE``.
"""

from __future__ import annotations

import json
import sys

import torch

from cachefeed._trainer import EpochLoaderFactory


def contexts() -> list[int]:
    return [i for i in range(torch.cuda.device_count()) if torch._C._cuda_hasPrimaryContext(i)]  # type: ignore[attr-defined]


def main(root: str, device: int) -> None:
    report: dict[str, object] = {}
    target = torch.device("cuda", device)
    with EpochLoaderFactory(
        root, batch_size=32, num_workers=2, shuffle=False, pin_memory=True, run_id="ctx", epochs=1, progress=None
    ) as factory:
        batches = iter(factory.loader(0))
        first = next(batches)  # the workers started and wrote a batch before anything used CUDA
        report["contexts_before_use"] = contexts()
        copies = [(first["__key__"], first["data"].clone(), first["data"].to(target, non_blocking=True))]
        report["first_pinned"] = first["data"].is_pinned()  # after the copy: is_pinned may make a context where none is
        del first
        pinned = []
        busy = torch.randn(4096, 4096, device=target)
        for batch in batches:
            pinned.append(batch["data"].is_pinned())
            for _ in range(4):  # the copy below waits behind this work on cuda:<device>'s current stream
                busy = busy @ busy
                busy = busy / busy.norm()
            expected = batch["data"].clone()
            copies.append((batch["__key__"], expected, batch["data"].to(target, non_blocking=True)))
            del batch  # the host batch is gone while its copy is still queued
        torch.cuda.synchronize(target)
        report["later_pinned"] = pinned
        report["intact"] = all(torch.equal(expected, on_device.cpu()) for _keys, expected, on_device in copies)
        report["contexts_after"] = contexts()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
