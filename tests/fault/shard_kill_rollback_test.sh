#!/usr/bin/env bash
# Fault drill, real processes on loopback, replication 0: optimus-shard 0 is
# killed with SIGKILL mid-training. The coordinator detects it by its lease,
# rolls the job back to its last checkpoint onto the shard left, the workers
# re-join and redo the steps since; training completes, nothing hangs, and the
# final parameters are bitwise those of a run that never failed (the restored
# state is the failure-free run's state at the checkpoint's step, and the
# math does not depend on placement).
set -euo pipefail

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"
run() {  # run NAME [extra flags...]
  local name=$1; shift
  run_cluster "${name}" --steps=400 --hidden=256 "$@"
}

run drill --checkpoint_every_steps=50 --kill_shard_at_step=300
run clean --steps="$(steps_of drill)"

drill=$(tail -n 1 "${TEST_TMPDIR}/drill.out")
echo "drill:  ${drill}"
echo "clean:  $(tail -n 1 "${TEST_TMPDIR}/clean.out")"
python3 - "${drill}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["steps"] >= 400 and s["shard_killed_at_step"] >= 300, s
assert s["shard_killed_at_step"] < s["steps"], s
assert s["final_loss"] < s["initial_loss"], s
assert s["max_abs_diff_vs_local_adamw"] <= 1e-2, s
PY
coord="${TEST_TMPDIR}/drill/coord.log"
grep -q "rolled back to checkpoint" "${coord}" || {
  echo "the coordinator did not roll the job back:"; cat "${coord}"; exit 1; }
resumed=$(grep -ho "resuming at step [0-9]*" "${TEST_TMPDIR}"/drill/worker-*.log | sort -u)
echo "workers: ${resumed}"
[ "$(echo "${resumed}" | wc -l)" = 1 ] || { echo "workers resumed at different steps"; exit 1; }

# The workers learned of the dead shard from the transport, not by waiting
# out a timeout.
if grep -h "failed (DEADLINE_EXCEEDED" "${TEST_TMPDIR}"/drill/worker-*.log; then
  echo "a worker waited for a timeout instead of seeing the shard fail"; exit 1
fi

same_params drill clean

no_processes_left
echo "ok: shard killed, job rolled back and finished, parameters bitwise equal to the failure-free run"
