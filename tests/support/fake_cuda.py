"""A fake GPU behind ``CudaRuntime`` (``cachefeed/_trainer/cuda.py``): several devices, several streams, copies that
run only when the test says so.

What it models of CUDA, and nothing more:

* a device is *in use* once its context exists; every runtime call on a device (an event recorded on one of its
  streams, a registration from it) and every copy to it creates its context, and ``created`` lists the devices
  whose context the code under test or the test made, in order;
* each stream runs its queued work in order, one item per ``step`` (or all of it: ``run``); an event recorded on a
  stream has passed once the stream ran everything queued before it;
* a copy from host memory in a registered range (``host_register``) reads that memory when the stream *runs* it, as
  a DMA does; a copy from any other memory reads it when it is *queued* (pageable memory: the copy is synchronous
  with the host). A copy that finds other bytes than its source held when it was queued is *torn*: ``torn`` lists
  them, and is what the tests check;
* ``pin`` is torch's ``pin_memory()``: a copy of the batch in memory of its own, which torch guards itself.

Host memory is read by address (``ctypes.string_at``): the test keeps the memory mapped (the pool open) until the
queued copies ran.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class FakeStream:
    device: int
    name: str
    queued: list[_Copy] = field(default_factory=list)
    ran: int = 0

    @property
    def pending(self) -> int:
        return len(self.queued) - self.ran


@dataclass
class _Copy:
    address: int
    nbytes: int
    source: bytes  # what the host memory held when the copy was queued
    dma: bool  # reads the host memory when it runs (pinned), not when queued


@dataclass
class FakeEvent:
    gpu: FakeCuda
    stream: FakeStream
    position: int

    def query(self) -> bool:
        return self.stream.ran >= self.position

    def synchronize(self) -> None:
        while self.stream.ran < self.position:
            self.gpu.step(self.stream)


class FakeCuda:
    """``CudaRuntime`` over a fake GPU of ``devices`` devices; ``in_use``: devices whose context exists already."""

    def __init__(
        self,
        devices: int = 2,
        *,
        current: int = 0,
        in_use: tuple[int, ...] = (),
        tracks_contexts: bool = True,
        register_error: int = 0,
    ) -> None:
        self.devices = devices
        self.current = current
        self.contexts = set(in_use)
        self.created: list[int] = []
        self._tracks_contexts = tracks_contexts
        self.register_error = register_error
        self.streams = [FakeStream(device, "default") for device in range(devices)]
        self._current_streams = list(self.streams)
        self.registered: dict[int, int] = {}  # address -> nbytes
        self.registrations: list[tuple[int, int, int]] = []  # (device, address, nbytes), every one made
        self.unregistrations: list[int] = []
        self.torn: list[str] = []
        self.dma_copies = 0
        self.pinned_by_torch = 0

    # -- CudaRuntime -------------------------------------------------------------------------------------------

    @property
    def tracks_contexts(self) -> bool:
        return self._tracks_contexts

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def has_context(self, device: int) -> bool:
        return device in self.contexts

    def current_stream(self, device: int) -> FakeStream:
        return self._current_streams[device]

    def record(self, stream: FakeStream) -> FakeEvent:
        self._touch(stream.device)
        return FakeEvent(self, stream, len(stream.queued))

    def host_register(self, device: int, address: int, nbytes: int) -> int | None:
        self._touch(device)
        if self.register_error:
            return self.register_error
        page = mmap.PAGESIZE
        first, last = address // page, (address + nbytes - 1) // page
        for start, size in self.registered.items():  # CUDA locks whole pages: a page locked twice is refused
            if first <= (start + size - 1) // page and start // page <= last:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[address] = nbytes
        self.registrations.append((device, address, nbytes))
        return 0

    def host_unregister(self, device: int, address: int) -> int | None:
        self._touch(device)
        for stream in self.streams:  # every device in use is synchronized first
            if stream.device in self.contexts:
                self.run(stream)
        del self.registered[address]
        self.unregistrations.append(address)
        return 0

    def pin(self, batch: Any) -> Any:
        self.pinned_by_torch += 1
        return _copied(batch)

    # -- the GPU, as the test drives it -----------------------------------------------------------------------

    def stream(self, device: int) -> FakeStream:
        """A new side stream on ``device``."""
        created = FakeStream(device, f"side{len(self.streams)}")
        self.streams.append(created)
        return created

    def set_current_stream(self, device: int, stream: FakeStream) -> None:
        self._current_streams[device] = stream

    def is_pinned(self, address: int, nbytes: int) -> bool:
        return any(start <= address and address + nbytes <= start + size for start, size in self.registered.items())

    def copy(self, tensor: torch.Tensor, device: int, stream: FakeStream | None = None) -> None:
        """Queue the copy of ``tensor`` (contiguous) to ``device`` on ``stream`` (default: the current one)."""
        self._touch(device)
        stream = stream if stream is not None else self._current_streams[device]
        assert stream.device == device and tensor.is_contiguous()
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        dma = self.is_pinned(address, nbytes)
        self.dma_copies += dma
        stream.queued.append(_Copy(address, nbytes, ctypes.string_at(address, nbytes), dma))

    def step(self, stream: FakeStream) -> None:
        """Run the next queued copy of ``stream``, if any."""
        if stream.pending:
            copy = stream.queued[stream.ran]
            stream.ran += 1
            if copy.dma and ctypes.string_at(copy.address, copy.nbytes) != copy.source:
                self.torn.append(f"{copy.nbytes} bytes at {copy.address:#x} on {stream.name} of cuda:{stream.device}")

    def run(self, stream: FakeStream) -> None:
        while stream.pending:
            self.step(stream)

    def run_all(self) -> None:
        for stream in self.streams:
            self.run(stream)

    def _touch(self, device: int) -> None:
        if device not in self.contexts:
            self.contexts.add(device)
            self.created.append(device)


def _copied(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {key: _copied(value) for key, value in batch.items()}
    if isinstance(batch, list):
        return [_copied(value) for value in batch]
    return batch
