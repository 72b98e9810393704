"""Batches moved to a CUDA device ahead of use: the copy of batch ``i + 1`` overlaps the compute on batch ``i``.

How the streams are kept honest (the copy runs on a side stream, the training step on the current stream):

1. the copy of batch ``i + 1`` is issued on the side stream after it *waits for the current stream*
   (``side.wait_stream(current)``), so it never overwrites memory the step is still reading when the caching
   allocator reuses a block;
2. before batch ``i + 1`` is handed out, the current stream waits for the side stream (``wait_stream``), so the
   step never reads a half-copied tensor;
3. every tensor handed out is marked ``record_stream(current)``: its memory was allocated on the side stream, and
   without this the allocator could give it to another side-stream copy while the step still reads it;
4. the *host* batch is kept alive until an event recorded on the side stream after its copy has passed
   (``InFlightCopies``): an asynchronous copy reads the host memory after ``to()`` returns, and the pool fences
   freed regions only on the current streams (NOTE [ Pinned arenas ] in ``pinning.py``), not on this side stream.
   A prefetcher of your own that copies on a side stream must do the same, whatever its depth.

Copies are ``non_blocking``; they only overlap when the source is in pinned memory (build the loader with
``pin_memory=True``). A pageable source still works, the copy is then synchronous with the host.

The prefetcher takes batch ``i + 1`` from the loader before it yields batch ``i``; it tells an ``EpochLoader``'s
iterator so (``hold``, see ``epoch.py``), and ``factory.state_dict()`` after the step on batch ``i`` counts ``i + 1``
batches consumed: a resume gives batch ``i + 1`` next.

On a CPU device (or ``device=None`` without CUDA) the prefetcher is a pass-through: batches are handed out as the
loader makes them, nothing is copied. On any other device (``mps``, ``xpu``, ...) each batch is moved with a plain
``to(device)`` as it is handed out, without look-ahead: the stream protocol above is CUDA's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from cachefeed._trainer.cuda import CudaRuntime, Event, TorchCuda

__all__ = ["DevicePrefetcher", "InFlightCopies", "move_to"]


def move_to(batch: Any, device: torch.device, *, non_blocking: bool) -> Any:
    """Copy every tensor in a nest of dicts, lists, tuples and named tuples to ``device``; keep the rest."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {key: move_to(value, device, non_blocking=non_blocking) for key, value in batch.items()}
        return moved if type(batch) is dict else _rebuild(batch, moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(move_to(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, list | tuple):
        items = [move_to(v, device, non_blocking=non_blocking) for v in batch]
        return items if type(batch) is list else _rebuild(batch, items)
    return batch


def _rebuild(original: Any, contents: Any) -> Any:
    """The same container type holding ``contents`` when its constructor allows it, else the plain one."""
    try:
        return type(original)(contents)
    except TypeError:
        return contents


def _record(batch: Any, stream: Any) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            _record(value, stream)
    elif isinstance(batch, list | tuple):
        for value in batch:
            _record(value, stream)


class InFlightCopies:
    """Host batches kept alive until the copies from them, queued on a stream, have run ((4) above).

    ``add`` after queuing a batch's copies on ``stream``; ``release_done`` drops the batches whose copies ran
    (in the order they were added: one stream runs its work in order); ``wait`` blocks until every copy ran.
    """

    def __init__(self, runtime: CudaRuntime) -> None:
        self._runtime = runtime
        self._copying: deque[tuple[Event, Any]] = deque()

    def add(self, host: Any, stream: Any) -> None:
        """Keep ``host`` until everything queued on ``stream`` so far has run."""
        self._copying.append((self._runtime.record(stream), host))

    def release_done(self) -> None:
        while self._copying and self._copying[0][0].query():
            self._copying.popleft()

    def wait(self) -> None:
        while self._copying:
            self._copying[0][0].synchronize()
            self._copying.popleft()


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device`` (see the module docstring for the protocol).

    Args:
        loader: any iterable of batches (an ``EpochLoader``, a DataLoader, a list).
        device: the target; default ``cuda`` (the current device) when CUDA is available, else CPU (pass-through);
            another device gets each batch moved as it is handed out (module docstring).
        non_blocking: issue asynchronous copies (they overlap only from pinned memory).

    ``len()`` is the loader's. Each ``iter()`` starts a new pass over the loader.
    """

    def __init__(
        self, loader: Iterable[Any], device: torch.device | str | None = None, *, non_blocking: bool = True
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.loader = loader
        self.device = torch.device(device)
        self.non_blocking = non_blocking

    @property
    def is_passthrough(self) -> bool:
        """Batches are handed out as the loader makes them (a CPU device)."""
        return self.device.type == "cpu"

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.is_passthrough:
            yield from self.loader
            return
        if self.device.type != "cuda":  # mps, xpu, ...: moved in place of the CUDA protocol (it went unmoved)
            for batch in self.loader:
                yield move_to(batch, self.device, non_blocking=False)
            return
        yield from self._cuda_batches()

    def _cuda_batches(self) -> Iterator[Any]:
        side = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        batches = iter(self.loader)
        hold = getattr(batches, "hold", None)  # an EpochLoader's: batches taken ahead are not consumed yet
        copying = InFlightCopies(TorchCuda())  # host batches whose copies may still read them

        def issue() -> Any:
            copying.release_done()  # (4): copies done, their host batches may go
            try:
                host = next(batches)
            except StopIteration:
                return _DONE
            if hold is not None:
                hold(1)
            side.wait_stream(torch.cuda.current_stream(self.device))  # (1) in the module docstring
            with torch.cuda.stream(side):
                moved = move_to(host, self.device, non_blocking=self.non_blocking)
            copying.add(host, side)
            return moved

        try:
            ahead = issue()
            while ahead is not _DONE:
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(side)  # (2)
                _record(ahead, current)  # (3)
                ready, ahead = ahead, issue()
                if hold is not None:
                    hold(-1)
                yield ready
        finally:
            copying.wait()  # (4) also when the loop ends or breaks: no host batch goes mid-copy


_DONE = object()
