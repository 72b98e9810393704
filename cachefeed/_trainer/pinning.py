"""The workers' arenas as pinned host memory for CUDA copies (``WorkerPool(pin_memory=True)`` where CUDA is).

NOTE [ Pinned arenas ]
----------------------
With ``pin_memory``, each worker's arena (``arena.py``) is page-locked with ``cudaHostRegister`` once, when the
worker starts, so the batches the workers write there are pinned where they lie and ``.to(device,
non_blocking=True)`` runs as a DMA while the training thread goes on. Three rules keep that correct:

* **Registration runs on a short-lived thread** whose current device is the training thread's. A failed CUDA
  runtime call leaves its error as the calling thread's "last error", and torch's next kernel-launch check would
  raise it from an unrelated kernel; on a thread of its own it dies with the thread. A failure only logs: copies
  from pageable memory are synchronous, still correct.
* **A region goes back to its worker only once the GPU has read it.** A region is freed when no Python object
  refers to it any more, which for ``x = batch["x"].cuda(non_blocking=True)`` is right after the copy was queued,
  not done. torch guards its own pinned blocks with an event recorded on each copy; it does not guard memory
  registered from outside. So the pool records a fence (a CUDA event on the current stream of the pinned
  device) each time the training thread asks for a batch and regions were freed since the last one, and gives
  those regions back to their worker only once the fence has passed. A copy queued before the host tensor was
  dropped, on that stream, is ordered before the fence. A copy on another stream or device must keep its host
  tensor until it completes, as ``DevicePrefetcher`` does (it holds each host batch until its own event passed).
* **Unregistration waits for the device** (``torch.cuda.synchronize``) and happens before the arena is unmapped:
  when the pool closes and when a dead worker's arena is dropped. Tensors over the arena stay valid after it
  (they are then pageable memory). A range left registered would stay locked in RAM until the process exits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cachefeed._logs import get_logger
from cachefeed._trainer.arena import Arena

__all__ = ["PinnedArenas"]

log = get_logger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, whichever device registered it


class PinnedArenas:
    """The pool's CUDA side: page-locks arenas, releases them, and fences regions until the GPU has read them.

    The device pinned for is the current one of the thread that starts the first worker (the training thread's,
    as for torch's pin-memory thread). ``register``/``unregister`` run under the pool's lock; ``fence`` on the
    training thread, ``passed`` on any thread.
    """

    def __init__(self) -> None:
        self.device: int | None = None  # chosen by the first ``register``: CUDA is not touched before
        self._registered: dict[int, int] = {}  # id(arena) -> its address, while registered

    def register(self, arena: Arena) -> bool:
        """Page-lock ``arena``; False (logged) where CUDA refused, then its copies are synchronous."""
        if self.device is None:
            self.device = torch.cuda.current_device()
        address = _address(arena)
        code = self._on_device_thread(lambda cudart: int(cudart.cudaHostRegister(address, arena.size, _PORTABLE)))
        if code is None:  # logged where it raised
            return False
        if code != 0:
            log.warning(
                "cudaHostRegister of a cachefeed worker's %d MiB of shared memory failed (CUDA error %s): copies of "
                "its batches to the GPU will not overlap the training step (check `ulimit -l` and free RAM)",
                arena.size >> 20,
                code,
            )
            return False
        self._registered[id(arena)] = address
        return True

    def unregister(self, arena: Arena) -> None:
        """Release ``arena``'s page lock once the device is idle (no copy from it can still be queued)."""
        address = self._registered.pop(id(arena), None)
        if address is None:
            return

        def release(cudart: Any) -> int:
            torch.cuda.synchronize()
            return int(cudart.cudaHostUnregister(address))

        code = self._on_device_thread(release)
        if code:  # None: logged where it raised
            log.warning("cudaHostUnregister of a cachefeed worker's shared memory failed (CUDA error %s)", code)

    def fence(self) -> Any:
        """A mark after every copy queued so far on the current stream of the pinned device."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def passed(self, fence: Any) -> bool:
        """Whether the GPU is past ``fence`` (every copy queued before it is done)."""
        return bool(fence.query())

    def _on_device_thread(self, call: Callable[[Any], int]) -> int | None:
        """``call(cudart)`` on a new thread set to the pinned device; its result, or None (logged) where it raised."""
        result: list[int | None] = [None]

        def run() -> None:
            try:
                torch.cuda.set_device(self.device)
                result[0] = call(torch.cuda.cudart())  # type: ignore[no-untyped-call]
            except Exception as exc:  # a CUDA build without the runtime binding
                log.warning("the CUDA runtime call on cachefeed's shared memory failed: %s", exc)

        thread = threading.Thread(target=run, name="cachefeed-pin", daemon=True)
        thread.start()
        thread.join()
        return result[0]


def _address(arena: Arena) -> int:
    """The address of ``arena``'s map in this process."""
    return int(np.frombuffer(arena.map, dtype=np.uint8).ctypes.data)
