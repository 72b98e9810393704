#!/usr/bin/env bash
# What a machine with a CUDA GPU checks of cachefeed, in one run: the tests marked `gpu` with the rest of the files
# that hold them (their CPU paths change where CUDA is present), then benchmarks/feed_gpu.py with the daemon.
#
#   CACHEFEED_COMMIT=$(git rev-parse HEAD) scripts/gpu_checks.sh OUT_DIR [feed_gpu arguments...]
#
# The committed feed_gpu result was run with `--batch 256,64 --samples 16384 --steps 40 --warmup 5 --repeats 10`
# (about 2 min on one H100, the daemon's files on /dev/shm included): at batch 64 the loop drifts by 20-30% within a
# minute, and many short repeats, paired with the ceiling's, say more than a few long runs. The tests take about
# 1 min with -n 4.
#
# Run it from the repository root of a clean checkout, or of a copy of one: CACHEFEED_COMMIT names the commit,
# which benchmarks/common/results.py records with the result (a copy's own .git may name another). The project's
# dependencies must be importable (PYTHONPATH=. with them installed beside torch; not `pip install -e .`, whose
# constraints pin a CPU torch). OUT_DIR gets gpu_tests.log, feed_gpu.log and feed_gpu.json. Exits non-zero if
# either step failed. The tests run with -s: test_device_overlap prints its timings.
set -uo pipefail
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [feed_gpu arguments...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# A short or missing hash would fail the result's save only after the whole benchmark ran: check it first.
if [ -n "${CACHEFEED_COMMIT:-}" ] && ! [[ "$CACHEFEED_COMMIT" =~ ^[0-9a-f]{40}$ ]]; then
    echo "CACHEFEED_COMMIT=$CACHEFEED_COMMIT: expected a full commit hash (git rev-parse HEAD)" >&2
    exit 2
fi
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), "device(s)")' || exit 2
# addopts cleared (its -n 3 suits a 2-core CI machine); pytest-benchmark, where installed, warns under xdist, and
# the project's filterwarnings turns that warning into an error.
python3 -m pytest -p no:cacheprovider -p no:benchmark -o addopts="" --strict-markers -ra --timeout=300 -n 4 -v -s \
    tests/trainer/test_device.py tests/trainer/test_device_overlap.py tests/trainer/test_pinning.py \
    tests/trainer/test_frameworks.py tests/test_benchmarks_smoke.py::test_feed_gpu_runs_every_system_on_a_cpu_with_a_tiny_model \
    tests/witness/test_resume_promises.py \
    2>&1 | tee "$out/gpu_tests.log"
tests=$?
python3 -m benchmarks.feed_gpu --daemon "$@" 2>&1 | tee "$out/feed_gpu.log"
bench=$?
[ "$bench" -eq 0 ] && cp benchmarks/results/feed_gpu.json "$out/"  # not the committed one after a failed run
echo "tests: exit $tests; feed_gpu: exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
