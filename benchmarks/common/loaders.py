"""An :class:`~benchmarks.common.adapter.EpochSource` over one ``torch.utils.data.DataLoader``.

Most systems are "a dataset plus a DataLoader": iterating the loader again is the next epoch. This wrapper
optionally calls the dataset's ``set_epoch`` (for systems whose loader does not), and shuts persistent workers
down on ``close``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any, cast


class DataLoaderSource:
    """Epochs of one DataLoader. ``on_close`` runs after the loader is released (system-specific cleanup)."""

    def __init__(self, loader: Any, on_close: Callable[[], None] | None = None, call_set_epoch: bool = False) -> None:
        self.loader = loader
        self._on_close = on_close
        self._call_set_epoch = call_set_epoch

    def epoch(self, epoch: int) -> Iterable[Any]:
        if self._call_set_epoch:
            self.loader.dataset.set_epoch(epoch)
        return cast(Iterable[Any], self.loader)

    def close(self) -> None:
        if self.loader is None:
            return
        iterator = getattr(self.loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self.loader = None
        gc.collect()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
