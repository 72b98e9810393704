"""The workers' arenas as pinned host memory for CUDA copies (``WorkerPool(pin_memory=True)`` where CUDA is).

NOTE [ Pinned arenas ]
----------------------
With ``pin_memory``, each worker's arena (``arena.py``) is page-locked with ``cudaHostRegister``, span by span (the
arena's first ``arena_bytes`` when the worker starts, each span it grows by later), so the batches the workers write
there are pinned where they lie and ``.to(device, non_blocking=True)`` runs as a DMA while the training thread goes
on. Every CUDA call goes through ``CudaRuntime`` (``cuda.py``).

**The promise.** A region of an arena goes back to its worker only once every copy from it that torch queued *on
the current stream of its device, as the training thread sees that stream when it asks for its next batch,* has
run. That is torch's own promise for its pinned blocks for the usual loop (``x = batch["x"].cuda(non_blocking=
True)``, then drop the batch), on any device and on several devices: the GPU of a DDP rank that never called
``torch.cuda.set_device`` (``model.to(rank)``), a model on ``cuda:1``, a batch split over two GPUs. How:

* A region is freed when no Python object refers to it any more, which for the loop above is right after the copy
  was queued, not done. So each time the training thread asks for a batch and regions were freed since the last
  time, the pool records a *fence*: one CUDA event on the current stream of *every device in use* (a device whose
  primary context exists, as torch's own pinned allocator and ``Tensor.is_pinned`` tell; a device without one can
  have no copy queued). The regions go back once every event of their fence has passed. A copy queued on one of
  those streams before its host tensor was dropped is ordered before the fence.
* Nothing creates a context on a device nobody uses: an arena is registered from a device in use (the current one
  if it is), and while no device is in use (the loader started before the model went to its GPU) its spans wait,
  unregistered, until one is: batches are then pageable and their copies synchronous, still correct.
* A copy on *another* stream (a side stream of the caller's own prefetcher) is not ordered before the fence. Whoever
  issues it keeps the host batch alive until an event recorded on that stream after the copy has passed:
  ``DevicePrefetcher`` does (``InFlightCopies`` in ``device.py``, with a queue of any depth), and the README says
  what a prefetcher of the caller's own must do. The same holds for a copy queued on another thread whose current
  stream is not the training thread's, or made by another library than torch.
* **Where the pool cannot keep the promise it does not pin in place**: where this torch build cannot tell which
  devices are in use (no ``torch._C._cuda_hasPrimaryContext``) or ``cudaHostRegister`` failed (``ulimit -l``, RAM),
  each batch (and each batch sent whole through the pipe) is copied into torch's own pinned memory with
  ``pin_memory()``, whose copies torch guards itself: slower, never a weaker guard. One log line says so.
* Registration and unregistration run on a short-lived thread set to a device in use (``cuda.py`` says why).
  Unregistration waits for every device in use (``synchronize``) and happens before the arena is unmapped: when the
  pool closes and when a dead worker's arena is dropped. A range left registered would stay locked until exit.

**What the tests show and what only a GPU run can confirm.** Without a GPU, a fake runtime whose devices and
streams run their queued copies only when the test says so (``tests/support/fake_cuda.py``) shows the logic: no
region is rewritten before every copy from it ran, with copies on ``cuda:1`` while the current device is 0, on two
devices, and from a side-stream queue two deep; no context is created on an idle device. That the real calls do
what the fake models needs a GPU (the ``gpu`` tests): that ``cudaHostRegister`` on a memfd's shared map makes its
tensors ``is_pinned()`` and their copies asynchronous, that ``_cuda_hasPrimaryContext`` and event records create no
context, and that a copy queued on ``cuda:1`` is really overwritten without the fence on ``cuda:1`` (two GPUs).
On one H200 (at 627c868) and one H100 (at 9791a3d), torch 2.11, 2026-11-26, and on an H200 again at 4181518
(2026-11-27), ``scripts/gpu_checks.sh``, the one-GPU ``gpu`` tests passed: arenas pinned in place, no context
before the loop used its GPU, copies dropped at once intact. Run by hand on the H200 with ``fence`` made to return
no event, the dropped-copies test failed (a sample overwritten under its queued copy): on a real GPU the fence is
what keeps it intact, and the test can tell. The two-GPU test has not run: no machine with two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cachefeed._logs import get_logger
from cachefeed._trainer.arena import Arena
from cachefeed._trainer.cuda import CudaRuntime, Event, TorchCuda
from cachefeed._units import format_bytes

__all__ = ["Fence", "PinnedArenas"]

log = get_logger(__name__)

Fence = list[Event]  # one event per device in use when it was recorded


@dataclass(slots=True)
class _Span:
    """``[start, end)`` of an arena (offsets), registered from ``device`` once it is."""

    address: int
    start: int
    end: int
    device: int | None = None  # None: waiting for a device in use
    failed: bool = False


class PinnedArenas:
    """The pool's CUDA side: page-locks arenas span by span, releases them, fences regions (NOTE above).

    ``register``, ``register_pending`` and ``unregister`` run under the pool's lock; ``fence`` and ``pin`` on the
    training thread, ``passed`` and ``covers`` on any thread.

    Args:
        runtime: the CUDA calls (default: torch's).
    """

    def __init__(self, runtime: CudaRuntime | None = None) -> None:
        self._runtime: CudaRuntime = runtime if runtime is not None else TorchCuda()
        self._spans: dict[int, list[_Span]] = {}  # id(arena) -> its spans
        self._waiting = 0  # spans waiting for a device in use
        self._told_fallback = False  # one line says why batches are copied into torch's pinned memory
        # Devices whose context exists: a context lasts as long as the process, so a device found in use is never
        # probed again (the fence runs once a batch on the training thread); the others are probed at each fence.
        self._in_use: set[int] = set()
        self._device_count: int | None = None

    def register(self, arena: Arena, start: int, end: int) -> None:
        """Page-lock ``[start, end)`` of ``arena`` now, or once a device is in use; a failure is logged, and batches
        in that span are then copied into torch's pinned memory (``pin``)."""
        span = _Span(_address(arena) + start, start, end)
        self._spans.setdefault(id(arena), []).append(span)
        if not self._runtime.tracks_contexts:
            span.failed = True
            if not self._told_fallback:
                self._told_fallback = True
                log.warning(
                    "this torch build cannot tell which GPUs are in use (no torch._C._cuda_hasPrimaryContext), so "
                    "cachefeed cannot fence its shared memory: batches are copied into torch's pinned memory instead"
                )
            return
        self._waiting += 1
        self.register_pending()

    def register_pending(self) -> None:
        """Register the spans that wait for a device in use, if one is now (cheap while none waits)."""
        if not self._waiting:
            return
        device = self._device_in_use()
        if device is None:
            return
        for spans in self._spans.values():
            for span in spans:
                if span.device is None and not span.failed:
                    self._waiting -= 1
                    self._register(span, device)

    def _register(self, span: _Span, device: int) -> None:
        code = self._runtime.host_register(device, span.address, span.end - span.start)
        if code == 0:
            span.device = device
            return
        span.failed = True
        if code is not None and not self._told_fallback:  # None: logged where it raised
            self._told_fallback = True
            log.warning(
                "cudaHostRegister of %s of a cachefeed worker's shared memory failed (CUDA error %s): its "
                "batches are copied into torch's pinned memory instead (check `ulimit -l` and free RAM)",
                format_bytes(span.end - span.start),
                code,
            )

    def unregister(self, arena: Arena) -> None:
        """Release ``arena``'s page locks once every device in use is idle (no copy from it can still be queued)."""
        for span in self._spans.pop(id(arena), []):
            if span.device is None:
                self._waiting -= 0 if span.failed else 1
                continue
            code = self._runtime.host_unregister(span.device, span.address)
            if code:  # None: logged where it raised
                log.warning("cudaHostUnregister of a cachefeed worker's shared memory failed (CUDA error %s)", code)

    def covers(self, arena: Arena, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset + nbytes)`` of ``arena`` lies in a registered span (its tensors are pinned)."""
        return any(
            span.device is not None and span.start <= offset and offset + nbytes <= span.end
            for span in self._spans.get(id(arena), ())
        )

    def fence(self) -> Fence:
        """A mark after every copy queued so far on the current stream of every device in use."""
        runtime = self._runtime
        return [runtime.record(runtime.current_stream(device)) for device in self._devices_in_use()]

    def passed(self, fence: Fence) -> bool:
        """Whether every device is past ``fence`` (every copy queued before it on those streams is done)."""
        return all(event.query() for event in fence)

    def pin(self, batch: Any) -> Any:
        """``batch`` (not in a registered span) in pinned memory the standard torch way; as it is while no device
        is in use (its copies are then synchronous, and pinning it would create a context)."""
        if self._runtime.tracks_contexts and self._device_in_use() is None:
            return batch
        if not self._told_fallback:
            self._told_fallback = True
            log.warning(
                "batches that do not lie in shared memory registered with CUDA (sent whole through the pipe, or "
                "not registered yet) are copied into torch's pinned memory (pin_memory) before they are handed out"
            )
        return self._runtime.pin(batch)

    def _devices_in_use(self) -> list[int]:
        runtime = self._runtime
        if self._device_count is None:
            self._device_count = runtime.device_count()
        if len(self._in_use) < self._device_count:
            unknown = (device for device in range(self._device_count) if device not in self._in_use)
            self._in_use.update(device for device in unknown if runtime.has_context(device))
        return sorted(self._in_use)

    def _device_in_use(self) -> int | None:
        """The current device if it is in use, else the first in use, else None (torch's own choice for pinning)."""
        runtime = self._runtime
        current = runtime.current_device()
        if runtime.has_context(current):
            return current
        in_use = self._devices_in_use()
        return in_use[0] if in_use else None


def _address(arena: Arena) -> int:
    """The address of ``arena``'s map in this process."""
    return int(np.frombuffer(arena.map, dtype=np.uint8).ctypes.data)
