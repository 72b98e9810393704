"""What code written for a ``torch.utils.data.DataLoader`` reads off the loader it is given, answered for
``EpochLoader``; and ``pin_memory`` where nothing can use it.

Frameworks and training scripts read a DataLoader's attributes: Lightning calls ``set_epoch`` on
``loader.sampler`` and ``loader.batch_sampler.sampler`` when they have one, and reads both to judge shuffling
(``getattr`` on ``sampler`` first, then ``batch_sampler`` without a default); step-count arithmetic reads
``batch_size``, ``drop_last`` and ``len()``; logging reads ``num_workers``. ``EpochLoader`` is no DataLoader, so
neither Lightning nor Accelerate replaces its sampler or wraps it (both act only on ``DataLoader`` instances; the
README's "With Lightning or Accelerate" says what to set), but it answers these with what the factory does
(``DataLoaderAttributes``):

- ``batch_size``, ``drop_last``, ``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor``,
  ``timeout``, ``worker_init_fn``, ``multiprocessing_context``, ``generator``: the factory's arguments
  (``pin_memory`` as in effect: False where no accelerator is, see below; ``collate_fn`` where the caller gave none
  or ``default_collate``: ``collate_samples``, ``default_collate`` with the samples' fields checked first);
- ``persistent_workers``: True (the factory's workers serve every epoch);
- ``sampler``: this rank's sample indices of the epoch in the order they are served (``EpochSampler``, which reads
  no data); ``batch_sampler``: the same cut into batches (the ``EpochBatchSampler`` the epoch runs on). Neither
  has ``set_epoch``: the factory draws each epoch's order from (seed, epoch) itself, and splits it among ranks.

``pin_memory=True`` without an accelerator: torch's DataLoader (``num_workers=0``) warns "no accelerator is
found" at every iterator, that is every epoch, and the worker pool pins only with CUDA, silently.
``pin_memory_in_effect`` makes it one behaviour: the option is turned off and the factory logs one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Sampler

from cachefeed._logs import get_logger
from cachefeed._trainer.partition import EpochBatchSampler

__all__ = ["DataLoaderAttributes", "EpochSampler", "LoaderSettings", "pin_memory_in_effect"]

log = get_logger(__name__)


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; older: CUDA is the one that pins
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


def pin_memory_in_effect(options: Mapping[str, Any]) -> dict[str, Any]:
    """The DataLoader options with ``pin_memory`` turned off where no accelerator can use it, said in one log
    line (see the module docstring); otherwise the options unchanged."""
    if not options.get("pin_memory") or _has_accelerator():
        return dict(options)
    log.warning("pin_memory=True: no CUDA device (no accelerator) here, so batches stay in pageable memory")
    return {**options, "pin_memory": False}


@dataclass(frozen=True, slots=True)
class LoaderSettings:
    """The factory's DataLoader arguments, as its loaders report them."""

    batch_size: int
    drop_last: bool
    num_workers: int
    collate_fn: Callable[[list[Any]], Any]
    options: Mapping[str, Any]  # the other DataLoader options, pin_memory as in effect


class EpochSampler(Sampler[int]):
    """One rank's sample indices of one epoch (into the epoch's dataset), in the order they are served."""

    def __init__(self, indices: npt.NDArray[np.int64]) -> None:
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices.tolist())


class DataLoaderAttributes:
    """A DataLoader's attributes (the module docstring), from ``_loader_settings`` and ``_epoch_indices``."""

    _loader_settings: LoaderSettings

    @property
    def _epoch_indices(self) -> npt.NDArray[np.int64]:
        """This rank's indices of the epoch, in the order served (the subclass gives them)."""
        raise NotImplementedError

    @property
    def batch_size(self) -> int:
        return self._loader_settings.batch_size

    @property
    def drop_last(self) -> bool:
        return self._loader_settings.drop_last

    @property
    def num_workers(self) -> int:
        return self._loader_settings.num_workers

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return self._loader_settings.collate_fn

    @property
    def pin_memory(self) -> bool:
        return bool(self._loader_settings.options.get("pin_memory", False))

    @property
    def persistent_workers(self) -> bool:
        return True

    @property
    def prefetch_factor(self) -> int | None:
        factor = self._loader_settings.options.get("prefetch_factor")
        return (int(factor) if factor else 2) if self.num_workers else None

    @property
    def timeout(self) -> float:
        return float(self._loader_settings.options.get("timeout") or 0)

    @property
    def worker_init_fn(self) -> Callable[[int], None] | None:
        return self._loader_settings.options.get("worker_init_fn")

    @property
    def multiprocessing_context(self) -> Any:
        return self._loader_settings.options.get("multiprocessing_context")

    @property
    def generator(self) -> torch.Generator | None:
        return self._loader_settings.options.get("generator")

    @property
    def sampler(self) -> EpochSampler:
        return EpochSampler(self._epoch_indices)

    @property
    def batch_sampler(self) -> EpochBatchSampler:
        settings = self._loader_settings
        return EpochBatchSampler(self._epoch_indices, settings.batch_size, drop_last=settings.drop_last)
