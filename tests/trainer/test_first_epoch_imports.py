"""A job's first epoch imports nothing of cachefeed's or numpy's on the clock of its first batch.

A training script imports the loader factory before it starts training; what the factory's first ``loader(0)``
and its first batches import lazily comes on top of the cold start every job waits for (numpy loads
``numpy.random`` on first use, about 10 ms; the reader of the daemon's status document, about 5 ms; more on a busy
machine). Judged in a fresh interpreter, by its own ``sys.modules``: what was imported between the factory's
construction and the end of epoch 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cachefeed._testing.env import checkout_env
from tests.trainer.test_loader import build_cache

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: build the factory, then read epoch 0 with two forked workers.
_SCRIPT = """
import json, sys
from cachefeed import EpochLoaderFactory
factory = EpochLoaderFactory(
    sys.argv[1], batch_size=16, num_workers=2, multiprocessing_context="fork", run_id="t", epochs=1, progress=None
)
before = set(sys.modules)
keys = [key for batch in factory.loader(0) for key in batch["__key__"]]
factory.close()
print(json.dumps({"samples": len(keys), "distinct": len(set(keys)), "new": sorted(set(sys.modules) - before)}))
"""


def test_a_first_epoch_imports_no_module_of_cachefeed_or_numpy(tmp_path: Path) -> None:
    root = build_cache(tmp_path / "c", 200)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(root)],
        env=checkout_env(REPO),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["samples"] == report["distinct"] == 200, report
    late = [name for name in report["new"] if name.split(".")[0] in ("cachefeed", "numpy")]
    assert not late, f"imported during the first epoch: {late}"
