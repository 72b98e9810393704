"""The handover users get by default (no ``prepare_at``): the next epoch is built in the background and the
boundary does not wait for it, even while another process keeps a core busy."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefeed.trainer import EpochLoaderFactory
from tests.test_trainer_loader import build_cache, check_batch

EPOCHS = 4


@pytest.fixture
def busy_core() -> Iterator[None]:
    """A process spinning on one of the machine's cores for the whole test."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def test_the_default_schedule_prepares_each_epoch_before_the_boundary_under_load(
    tmp_path: Path, busy_core: None
) -> None:
    root = build_cache(tmp_path / "c", 1200)
    with EpochLoaderFactory(
        root, batch_size=20, num_workers=2, multiprocessing_context="fork", run_id="t", epochs=EPOCHS, progress=None
    ) as factory:
        for epoch in range(EPOCHS):
            keys = []
            for batch in factory.loader(epoch):
                keys += check_batch(batch)
                time.sleep(0.02)  # a training step
            assert sorted(keys) == sorted(f"k{i}" for i in range(1200)), f"epoch {epoch}: exactly once"
        waits = [factory.stats(epoch).handover_wait_s for epoch in range(1, EPOCHS)]
        builds = [factory.stats(epoch).build_s for epoch in range(1, EPOCHS)]
        print(f"\nhandover waits {waits} s; builds {builds} s")
        for epoch in range(1, EPOCHS):
            stats = factory.stats(epoch)
            assert stats.prepared_in_background, f"epoch {epoch} was built only when asked for"
            assert stats.handover_wait_s is not None
            # A wait well under the build (pin, dataset, DataLoader, two forked workers, first batch) means the
            # boundary found the epoch ready rather than building it.
            assert stats.handover_wait_s < 0.5 * stats.build_s, stats
