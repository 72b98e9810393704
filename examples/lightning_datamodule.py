"""Train with PyTorch Lightning from a cachefeed cache: a ``LightningDataModule`` over ``EpochLoaderFactory``.

    cachefeed daemon --config configs/s3-tmpfs.toml &
    python examples/lightning_datamodule.py /mnt/cachefeed/train --epochs 3

What Lightning needs (the README's "With Lightning or Accelerate"):

- ``Trainer(reload_dataloaders_every_n_epochs=1)``: Lightning then asks ``train_dataloader()`` at every epoch,
  which returns that epoch's loader, ``factory.loader(trainer.current_epoch)`` (a new snapshot of the cache, read
  receipts for the last one). Without it, Lightning would iterate epoch 0's loader every epoch.
- The factory is made in ``setup()``, which runs in every process after the process group exists, so each rank
  takes its own part of every epoch. Lightning replaces the sampler only of a ``torch.utils.data.DataLoader``,
  which an ``EpochLoader`` is not: ``use_distributed_sampler`` may stay as it is, nothing is split twice.
- ``run_id=``: the ranks of a node must name the same run; torchrun's environment does, Lightning's own
  launcher (``strategy="ddp"`` started with ``python``) does not, so the example passes one.

The model is a toy (it learns each vector's mean from the vector) so that the example runs on a CPU over any cache
whose samples hold a numeric ``data`` field, such as the demo's.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from torch import nn

from cachefeed import EpochLoader, EpochLoaderFactory


class CacheDataModule(L.LightningDataModule):
    """One ``EpochLoaderFactory`` per process; each epoch's loader from it."""

    def __init__(self, cache_dir: str, *, batch_size: int, num_workers: int, epochs: int, run_id: str) -> None:
        super().__init__()
        self.cache_dir, self.batch_size, self.num_workers = cache_dir, batch_size, num_workers
        self.epochs, self.run_id = epochs, run_id
        self.factory: EpochLoaderFactory | None = None

    def setup(self, stage: str) -> None:
        if self.factory is None:
            self.factory = EpochLoaderFactory(
                self.cache_dir,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                epochs=self.epochs,  # the factory prepares the next epoch's snapshot only while one is to come
                run_id=self.run_id,
            )

    def train_dataloader(self) -> EpochLoader:
        assert self.factory is not None and self.trainer is not None
        return self.factory.loader(self.trainer.current_epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.factory.state_dict() if self.factory is not None else {}

    def teardown(self, stage: str) -> None:
        if self.factory is not None:
            self.factory.close()
            self.factory = None


class MeanRegressor(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width, 1)

    def training_step(self, batch: dict[str, Any], batch_index: int) -> torch.Tensor:
        x = batch["data"].float().div(255)
        loss = nn.functional.mse_loss(self.layer(x), x.mean(1, keepdim=True))
        self.log("loss", loss, batch_size=len(x))
        return loss

    def on_train_epoch_end(self) -> None:
        factory = self.trainer.datamodule.factory
        stats = factory.stats(self.current_epoch)
        print(
            f"rank {self.global_rank} epoch {self.current_epoch}: {stats.batches_served} batches of "
            f"{stats.rank_samples} samples, snapshot {stats.snapshot_id}",
            flush=True,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256, help="length of each sample's data vector")
    parser.add_argument("--run-id", default="lightning")
    parser.add_argument("--devices", type=int, default=1, help="processes (DDP when > 1)")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu or auto (Lightning's choice: a GPU if any)")
    args = parser.parse_args()
    data = CacheDataModule(
        args.cache_dir, batch_size=args.batch, num_workers=args.workers, epochs=args.epochs, run_id=args.run_id
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        reload_dataloaders_every_n_epochs=1,  # a new loader, over a new snapshot, every epoch
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MeanRegressor(args.width), datamodule=data)


if __name__ == "__main__":
    main()
