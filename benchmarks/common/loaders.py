"""An :class:`~benchmarks.common.adapter.EpochSource` over one ``torch.utils.data.DataLoader``.

Most systems are "a dataset plus a DataLoader": iterating the loader again is the next epoch. This wrapper shuts
persistent workers down on ``close``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any, cast


class DataLoaderSource:
    """Epochs of one DataLoader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def epoch(self, epoch: int) -> Iterable[Any]:
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
