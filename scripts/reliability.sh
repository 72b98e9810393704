#!/usr/bin/env bash
# The reliability and security suite with its full counts (500 daemon kills, 100,000 hostile keys, ...).
#
#   scripts/reliability.sh              # everything: every scenario, with the full-count (-m slow) runs too
#   scripts/reliability.sh --slow-only  # only the full-count runs (pytest -m slow): crash loop, faults, keys
#   scripts/reliability.sh --default    # the bounded subset that the default test run includes (a few minutes)
#   scripts/reliability.sh -k crash     # extra arguments go to pytest
#
# Every scenario prints one "[reliability] <scenario>: key=value, ..." line of counts (faults injected, samples
# verified, violations); they are collected at the end, and written to the file $RELIABILITY_OUT if set (for the
# README). Needs root for the tmpfs scenarios (they skip otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

marker=(-m "slow or not slow")  # names "slow": tests/reliability/conftest.py then keeps the full-count runs
case "${1:-}" in
    --slow-only) marker=(-m slow); shift ;;
    --default) marker=(-m "not slow"); shift ;;
esac
out="${RELIABILITY_OUT:-}"
log="$(mktemp -t cachefeed-reliability.XXXXXX)"
trap 'rm -f "$log"' EXIT

python="${PYTHON:-.venv/bin/python}"
[[ -x "$python" ]] || python=python3

status=0
"$python" -m pytest tests/reliability -n 0 -s -q -rxXs --timeout=3600 "${marker[@]}" "$@" 2>&1 | tee "$log" || status=$?

echo
echo "=== figures: $(date -u +%Y-%m-%dT%H:%M:%SZ), $(uname -srm), $(nproc) cores, pytest ${marker[*]} $* ==="
grep -a '^\[reliability\]' "$log" || echo "(no scenario ran)"
if [[ -n "$out" ]]; then
    mkdir -p "$(dirname "$out")"
    { echo "# pytest ${marker[*]} $*"; grep -a '^\[reliability\]' "$log" || true; } >"$out"
fi
exit "$status"
