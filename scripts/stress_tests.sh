#!/usr/bin/env bash
# Run the process-heavy tests N times in a row while one core is kept busy, and stop at the
# first failure: the check that no test depends on an idle machine (docs/testing.md).
#
#   scripts/stress_tests.sh [N] [extra pytest args...]     (N defaults to 10)
#
# The busy loop is a bounded Python spin (it ends by itself after BUSY_MAX_S, 2 h by default)
# and is stopped, by its pid, when this script exits.
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-10}"
shift || true
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run 'make setup' first" >&2; exit 2; }

# signals, sandbox, migration under load, keys across isolates
TESTS=(tests/test_sandbox_signals.py tests/test_sandbox_cell.py tests/test_sandbox_pods.py
       tests/test_migration_e2e.py tests/test_worker_keys.py tests/test_generation_scale.py
       tests/test_hostile_clients.py tests/test_live_drift.py tests/test_fleet_front.py)

"$PY" -c "import time; end = time.monotonic() + float('${BUSY_MAX_S:-7200}')
while time.monotonic() < end: pass" &
busy=$!
trap 'kill "$busy" 2>/dev/null || true' EXIT

start=$(date +%s)
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  if ! "$PY" -m pytest -q -p no:cacheprovider -n 6 --dist loadfile "${TESTS[@]}" "$@"; then
    echo "stress: run $i of $runs FAILED (after $((i - 1)) passing runs)" >&2
    exit 1
  fi
  echo "stress: run $i of $runs passed in $(( $(date +%s) - t0 )) s"
done
echo "stress: $runs of $runs runs passed in $(( $(date +%s) - start )) s, one core kept busy throughout"
