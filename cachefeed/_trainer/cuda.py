"""The few CUDA calls the pinned arenas and the device prefetcher make, behind one small interface.

``CudaRuntime`` is what ``PinnedArenas`` (``pinning.py``) and ``InFlightCopies`` (``device.py``) call, and nothing
else of CUDA: ``TorchCuda`` implements it with torch, and the tests implement it with a fake GPU whose devices and
streams run their queued copies only when the test says so (``tests/support/fake_cuda.py``), which is how the
promise of NOTE [ Pinned arenas ] is tested without a GPU.

Contexts: nothing here creates a CUDA context on a device that has none. Devices are told apart the way torch's
own pinned-memory allocator and ``Tensor.is_pinned`` do (``getDeviceIndexWithPrimaryContext`` in c10): a device
is *in use* when its primary context exists (``torch._C._cuda_hasPrimaryContext``, which asks the driver and
creates nothing). Every call that needs a device runs on one that is in use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from cachefeed._logs import get_logger

__all__ = ["CudaRuntime", "Event", "TorchCuda"]

log = get_logger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever device registered it


class Event(Protocol):
    """A mark on a stream: passed once the stream ran everything queued on it before the mark."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaRuntime(Protocol):
    """The CUDA side of pinned arenas and of the prefetcher's host batches."""

    @property
    def tracks_contexts(self) -> bool:
        """Whether ``has_context`` can be asked (False: this torch build cannot tell which devices are in use)."""
        ...

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...

    def has_context(self, device: int) -> bool:
        """Whether ``device``'s primary context exists (creates none)."""
        ...

    def current_stream(self, device: int) -> Any:
        """The calling thread's current stream on ``device``."""
        ...

    def record(self, stream: Any) -> Event:
        """A new event recorded on ``stream`` (after everything queued on it so far)."""
        ...

    def host_register(self, device: int, address: int, nbytes: int) -> int | None:
        """``cudaHostRegister`` of ``nbytes`` at ``address`` (portable) from ``device``: the CUDA error code (0:
        done), or None where the call raised (logged)."""
        ...

    def host_unregister(self, device: int, address: int) -> int | None:
        """``cudaHostUnregister(address)`` from ``device``, once every device in use is idle; as ``host_register``."""
        ...

    def pin(self, batch: Any) -> Any:
        """``batch`` copied into pinned memory the standard torch way (torch then guards that memory itself)."""
        ...


class TorchCuda:
    """``CudaRuntime`` with torch. Runtime calls on host memory run on a short-lived thread set to a device in use:
    a failed CUDA runtime call leaves its error as the calling thread's "last error", and torch's next
    kernel-launch check would raise it from an unrelated kernel; on a thread of its own it dies with the thread."""

    @property
    def tracks_contexts(self) -> bool:
        return hasattr(torch._C, "_cuda_hasPrimaryContext")

    def device_count(self) -> int:
        return int(torch.cuda.device_count())

    def current_device(self) -> int:
        return int(torch.cuda.current_device())

    def has_context(self, device: int) -> bool:
        return bool(torch._C._cuda_hasPrimaryContext(device))  # type: ignore[attr-defined]

    def current_stream(self, device: int) -> Any:
        return torch.cuda.current_stream(device)

    def record(self, stream: Any) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)  # under torch's guard of the stream's device, restored without making a context
        return _DeviceEvent(event, int(stream.device_index))

    def host_register(self, device: int, address: int, nbytes: int) -> int | None:
        return _on_device_thread(device, lambda cudart: int(cudart.cudaHostRegister(address, nbytes, _PORTABLE)))

    def host_unregister(self, device: int, address: int) -> int | None:
        def release(cudart: Any) -> int:
            for index in range(self.device_count()):  # no copy from the range may still be queued anywhere
                if self.has_context(index):
                    torch.cuda.synchronize(index)
            return int(cudart.cudaHostUnregister(address))

        return _on_device_thread(device, release)

    def pin(self, batch: Any) -> Any:
        from torch.utils.data._utils.pin_memory import pin_memory

        return pin_memory(batch)  # type: ignore[no-untyped-call]


class _DeviceEvent:
    """A torch event queried and waited for with its own device current: the pool asks from several threads (the
    training, build and teardown threads), whose current device may be one nobody uses, and a runtime call there
    could make its context. ``torch.cuda.device`` restores the previous device without making one."""

    __slots__ = ("_device", "_event")

    def __init__(self, event: Any, device: int) -> None:
        self._event = event
        self._device = device

    def query(self) -> bool:
        with torch.cuda.device(self._device):
            return bool(self._event.query())

    def synchronize(self) -> None:
        with torch.cuda.device(self._device):
            self._event.synchronize()


def _on_device_thread(device: int, call: Callable[[Any], int]) -> int | None:
    """``call(cudart)`` on a new thread set to ``device``; its result, or None (logged) where it raised."""
    result: list[int | None] = [None]

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            result[0] = call(torch.cuda.cudart())  # type: ignore[no-untyped-call]
        except Exception as exc:  # a CUDA build without the runtime binding
            log.warning("the CUDA runtime call on cachefeed's shared memory failed: %s", exc)

    thread = threading.Thread(target=run, name="cachefeed-pin", daemon=True)
    thread.start()
    thread.join()
    return result[0]
