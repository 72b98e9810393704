"""Just enough of ``torch.cuda`` for ``DevicePrefetcher`` to run its CUDA path on a CPU: streams and events that
complete at once, and copies that return the batch itself. It checks the prefetcher's bookkeeping (what it takes
ahead, what it yields), not the device's ordering: ``fake_cuda.py`` models that, for the pool's fences."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.device = device

    def wait_stream(self, other: FakeStream) -> None:
        pass


class FakeEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeRuntime:
    """The one call of ``CudaRuntime`` the prefetcher makes."""

    def record(self, stream: FakeStream) -> FakeEvent:
        return FakeEvent()


@contextlib.contextmanager
def _stream(stream: FakeStream) -> Iterator[None]:
    yield


def install(monkeypatch: Any | None = None) -> None:
    """Patch ``torch.cuda`` and the prefetcher's copy so ``DevicePrefetcher(loader, "cuda")`` runs on a CPU.
    With ``monkeypatch`` (pytest's), undone after the test; without, for the life of the process."""
    import cachefeed._trainer.device as device

    current = FakeStream()
    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "Stream", FakeStream),
        (torch.cuda, "current_stream", lambda device=None: current),
        (torch.cuda, "stream", _stream),
        (device, "move_to", lambda batch, device, non_blocking: batch),
        (device, "_record", lambda batch, stream: None),
        (device, "TorchCuda", FakeRuntime),
    ]
    for target, name, value in patches:
        if monkeypatch is not None:
            monkeypatch.setattr(target, name, value)
        else:
            setattr(target, name, value)
