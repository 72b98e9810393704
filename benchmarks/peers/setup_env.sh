#!/usr/bin/env bash
# Create or refresh the benchmark environment .bench-venv (git-ignored): torch 2.13.0 CPU, mosaicml-streaming,
# litdata, moto[server], boto3, s3fs, psutil, matplotlib and cachefeed itself (editable).
#
#   benchmarks/peers/setup_env.sh            # idempotent: a second run installs nothing
#   BENCH_VENV=/tmp/v PYTHON=python3.11 benchmarks/peers/setup_env.sh
#
# Pins: /work/main/constraints.txt (the project's) + benchmarks/peers/constraints-peers.txt (why each exception).
# Before installing, a dry run is checked: anything that would install a torch other than 2.13.0, or CUDA
# packages, stops the script.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${BENCH_VENV:-$ROOT/.bench-venv}
PY=${PYTHON:-python3}
CONSTRAINTS=(-c "$ROOT/constraints.txt" -c "$ROOT/benchmarks/peers/constraints-peers.txt")
# What the peers and the harness import. mosaicml-streaming itself comes after, with --no-deps (see the pins).
PACKAGES=(
  torch==2.13.0 numpy xxhash boto3 s3fs "moto[server]" psutil matplotlib
  litdata torchvision lightning-utilities obstore
  Brotli python-snappy zstd tqdm catalogue transformers filelock
)
START=$SECONDS

say() { printf '[setup_env +%3ds] %s\n' $((SECONDS - START)) "$*"; }
pip_() {
  # pip, without the noise of the local indexes that do not carry every package.
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

if [[ -x "$VENV/bin/python" ]]; then
  say "using existing $VENV ($("$VENV/bin/python" --version))"
else
  say "creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi
say "pip==26.3 (older pips resolve the same set, slower)"
pip_ install --quiet pip==26.3

say "dry run: checking that nothing replaces torch 2.13.0 or pulls CUDA"
REPORT=$(mktemp)
LOG=$(mktemp)
trap 'rm -f "$REPORT" "$LOG"' EXIT
pip_ install --quiet --dry-run --report "$REPORT" "${CONSTRAINTS[@]}" "${PACKAGES[@]}"
"$VENV/bin/python" - "$REPORT" <<'PYEOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}
bad = [f"{n}=={v}" for n, v in names.items()
       if (n == "torch" and not v.startswith("2.13.0")) or n.startswith(("nvidia-", "triton", "cuda-"))]
if bad:
    sys.exit(f"refusing: the install would bring {bad}")
print(f"  would install {len(names)} packages: " + (", ".join(sorted(names)) or "nothing (up to date)"))
PYEOF

say "installing the peers and the harness's packages"
pip_ install --quiet "${CONSTRAINTS[@]}" "${PACKAGES[@]}"
say "installing mosaicml-streaming 0.13.0 with --no-deps (its numpy<2.2 / xxhash<4 caps conflict with the project's pins)"
pip_ install --quiet --no-deps "${CONSTRAINTS[@]}" mosaicml-streaming==0.13.0
say "installing cachefeed (editable, with its test extra: pytest runs benchmarks/common/test_common.py) from $ROOT"
# setuptools warns at length about the missing README and editable installs: keep its output unless it fails.
pip_ install --quiet "${CONSTRAINTS[@]}" -e "$ROOT[test]" >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }

say "pip check (mosaicml-streaming's declared caps and its unused cloud SDKs are expected here):"
"$VENV/bin/python" -m pip check 2>&1 | sed 's/^/  /' || true

say "verifying imports"
(cd "$ROOT" && "$VENV/bin/python" - <<'PYEOF'
import time
t = time.perf_counter()
import torch
if torch.__version__ != "2.13.0+cpu":
    raise SystemExit(f"torch is {torch.__version__}, expected 2.13.0+cpu")
from benchmarks.peers import compat
import streaming, litdata, s3fs, moto, psutil, cachefeed
print(f"  torch {torch.__version__}, mosaicml-streaming {streaming.__version__}, litdata {litdata.__version__},"
      f" s3fs {s3fs.__version__}, moto {moto.__version__}, psutil {psutil.__version__}; imports {time.perf_counter() - t:.1f}s")
print(f"  compat: {compat.report()} / {compat.patch_litdata_http()}")
PYEOF
)
say "done: $VENV"
