"""Train with Hugging Face Accelerate from a cachefeed cache: a plain loop over ``factory.loader(epoch)``.

    cachefeed daemon --config configs/s3-tmpfs.toml &
    accelerate launch examples/accelerate_loop.py /mnt/cachefeed/train --epochs 3   # or: python examples/...

What Accelerate needs (the README's "With Lightning or Accelerate"):

- ``accelerator.prepare`` the model and the optimizer, not the loader: ``prepare`` wraps only a
  ``torch.utils.data.DataLoader`` (an ``EpochLoader`` comes back unchanged), and cachefeed already gives each rank
  its own part of every epoch. Batches go to ``accelerator.device`` through ``DevicePrefetcher`` (pinned copies on
  a side stream with CUDA; a pass-through on the CPU).
- The factory is made after ``Accelerator()``, which sets up the process group under ``accelerate launch``, so
  the factory sees every rank; ``accelerate launch`` sets torchrun's environment, which names the run.
- ``accelerator.accumulate(model)`` works as with any loop; since the loader is not prepared, Accelerate does not
  know where an epoch ends, so a last partial accumulation is not forced to sync (``drop_last=True``, or an
  epoch length that ``gradient_accumulation_steps`` divides, keeps every step whole).

The model is a toy (it learns each vector's mean from the vector) so that the example runs on a CPU over any cache
whose samples hold a numeric ``data`` field, such as the demo's.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

from cachefeed import DevicePrefetcher, EpochLoaderFactory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256, help="length of each sample's data vector")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=args.cpu)  # first: under `accelerate launch` it sets up the process group
    model = nn.Linear(args.width, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)  # not the loader: see the module docstring
    with EpochLoaderFactory(
        args.cache_dir,
        batch_size=args.batch,
        num_workers=args.workers,
        pin_memory=accelerator.device.type == "cuda",
        epochs=args.epochs,
    ) as factory:
        for epoch in range(args.epochs):
            loss_sum = steps = 0.0
            for batch in DevicePrefetcher(factory.loader(epoch), accelerator.device):
                x = batch["data"].float().div(255)
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), x.mean(1, keepdim=True))
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                loss_sum, steps = loss_sum + float(loss.detach()), steps + 1
            stats = factory.stats(epoch)
            accelerator.print(
                f"epoch {epoch}: {stats.batches_served} batches, snapshot {stats.snapshot_id}, "
                f"mean loss {loss_sum / max(1, steps):.4f}"
            )


if __name__ == "__main__":
    main()
