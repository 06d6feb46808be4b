#!/usr/bin/env bash
# Fault drill, real processes on loopback: optimus-coord is killed with
# SIGKILL mid-training and restarted from its state folder. Training must go
# on while it is down, the restarted coordinator must know the shards and the
# job again, and the final parameters must be bitwise those of a failure-free
# run: no step lost.
set -euo pipefail

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"
run() {  # run NAME [extra flags...]
  local name=$1; shift
  run_cluster "${name}" --steps=200 --hidden=64 "$@"
}

run drill --kill_coordinator_at_step=20 --coordinator_down_ms=400
run clean --steps="$(steps_of drill)"

drill=$(tail -n 1 "${TEST_TMPDIR}/drill.out")
echo "drill:  ${drill}"
echo "clean:  $(tail -n 1 "${TEST_TMPDIR}/clean.out")"
python3 - "${drill}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["steps"] >= 200, s
assert s["coordinator_killed_at_step"] >= 20, s
# Workers kept training while the coordinator was down...
assert s["coordinator_restarted_at_step"] > s["coordinator_killed_at_step"], s
# ...and after it came back (training ends a set number of steps later).
assert s["coordinator_restarted_at_step"] < s["steps"], s
assert s["final_loss"] < s["initial_loss"], s
PY
grep -q "recovered state from" "${TEST_TMPDIR}/drill/coord-restarted.log" || {
  echo "the restarted coordinator did not load its state:"; cat "${TEST_TMPDIR}/drill/coord-restarted.log"; exit 1; }

# No step lost: the same bits as the failure-free run.
same_params drill clean

# A launcher that falls behind the workers (2 s between the restart and
# choosing the last step, hundreds of steps on a fast machine) still ends
# training at a step no worker has passed: it pauses them and reads all
# their progress first. Before, the workers failed ("asks to stop after
# step N but step M is under way"), as drain_test did once at load 9.
run lagging --kill_coordinator_at_step=20 --coordinator_down_ms=400 --launcher_lag_ms=2000
run clean-lagging --steps="$(steps_of lagging)"
same_params lagging clean-lagging

no_processes_left
echo "ok: coordinator killed at step $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["coordinator_killed_at_step"])' "${drill}"), parameters bitwise equal to the failure-free run"
