"""Train an image classifier from a cachefeed cache of a class-folder dataset (configs/images.toml).

    cachefeed daemon --config configs/images.toml &      # the daemon decodes, resizes and labels the images
    python examples/train_images.py /var/cache/cachefeed/images --epochs 10

Each batch holds ``image`` ([B, 3, 224, 224] uint8, decoded once by the daemon) and ``label`` ([B], the index of the
image's directory in ``factory.classes``, which lists every class of the remote from the first epoch on). The
model is a small convnet so that the example runs anywhere; swap in torchvision's ResNet on a GPU.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from cachefeed import DevicePrefetcher, EpochLoaderFactory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache_dir")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--samples-per-epoch", type=int, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with EpochLoaderFactory(
        args.cache_dir,
        batch_size=args.batch,
        num_workers=args.workers,
        samples_per_epoch=args.samples_per_epoch,
        pin_memory=device.type == "cuda",
        epochs=args.epochs,
    ) as factory:
        classes = factory.classes
        if not classes:
            raise SystemExit(f'{args.cache_dir} has no class list: set sampler.label = "parent" in the config')
        model = nn.Sequential(
            nn.Conv2d(3, 32, 5, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, len(classes)),
        ).to(device)  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for epoch in range(args.epochs):
            total = correct = 0
            for batch in DevicePrefetcher(factory.loader(epoch), device):
                images = batch["image"].float().div_(255)
                logits = model(images)
                loss = nn.functional.cross_entropy(logits, batch["label"])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += len(batch["label"])
                correct += int((logits.argmax(1) == batch["label"]).sum())
            stats = factory.stats(epoch)
            print(f"epoch {epoch}: {total} images of {len(classes)} classes, accuracy {correct / max(1, total):.3f}, "
                  f"{stats.new_samples} new since the last epoch")  # fmt: skip


if __name__ == "__main__":
    main()
