#!/usr/bin/env bash
# Run the process-heavy and time-based tests N times in a row while one core is kept busy, and
# stop at the first failure: the check that no test depends on an idle machine (docs/testing.md).
#
#   scripts/stress_tests.sh [N] [extra pytest args...]     (N defaults to 10)
#
# STRESS_WORKERS sets pytest's -n (default 8, as make test); BUSY=0 runs without the busy loop.
# Each run's whole output goes to .colocate/stress/<start>-run<i>.log; a failing run's log is
# named on the last line. The busy loop is a bounded Python spin (it ends by itself after
# BUSY_MAX_S, 2 h by default) and is stopped, by its pid, when this script exits.
set -euo pipefail
cd "$(dirname "$0")/.."

runs="${1:-10}"
shift || true
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run 'make setup' first" >&2; exit 2; }

# signals, sandbox, migration under load, keys across isolates, the sync, hostile clients, drift
# from live traffic, the front door; then the slow tests that wait on time: a fleet key's rpm in
# one minute and a lease forgotten, a short autoscaled day, the Tokyo demo, instructions per rung (skipped without valgrind)
TESTS=(tests/test_sandbox_signals.py tests/test_sandbox_cell.py tests/test_sandbox_pods.py
       tests/test_migration_e2e.py tests/test_worker_keys.py tests/test_generation_scale.py
       tests/test_hostile_clients.py tests/test_live_drift.py tests/test_fleet_front.py
       tests/test_fleet_limits.py tests/test_fleet_exchange.py tests/test_sandbox_autoscale.py tests/test_sandbox_demo.py
       tests/test_worker_instructions.py)

busy=""
if [ "${BUSY:-1}" != 0 ]; then
  "$PY" -c "import time; end = time.monotonic() + float('${BUSY_MAX_S:-7200}')
while time.monotonic() < end: pass" &
  busy=$!
fi
trap '[ -z "$busy" ] || kill "$busy" 2>/dev/null || true' EXIT

logs=.colocate/stress
mkdir -p "$logs"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
start=$(date +%s)
for i in $(seq 1 "$runs"); do
  t0=$(date +%s)
  log="$logs/$stamp-run$i.log"
  if ! "$PY" -m pytest -q -rfE -p no:cacheprovider -n "${STRESS_WORKERS:-8}" --dist loadfile "${TESTS[@]}" "$@" >"$log" 2>&1; then
    grep -E '^(FAILED|ERROR) ' "$log" >&2 || tail -n 20 "$log" >&2
    echo "stress: run $i of $runs FAILED (after $((i - 1)) passing runs); its whole output: $PWD/$log" >&2
    exit 1
  fi
  echo "stress: run $i of $runs passed in $(( $(date +%s) - t0 )) s ($(tail -n 1 "$log"))"
done
echo "stress: $runs of $runs runs passed in $(( $(date +%s) - start )) s$([ -n "$busy" ] && echo ', one core kept busy throughout')"
