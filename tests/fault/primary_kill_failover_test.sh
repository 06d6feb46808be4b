#!/usr/bin/env bash
# Fault drill, real processes on loopback, replication 1: three shard
# servers, every chunk has a backup on another shard. optimus-shard 0 is
# killed with SIGKILL mid-training. The coordinator detects it by its lease,
# promotes the backups of its chunks (new map epoch), picks new backups that
# their primaries seed in the background; the workers' clients re-route and
# resend their in-flight pushes. Training never stops: no worker re-joins, no
# step is redone, and the final parameters are bitwise those of a run that
# never failed (and had no replicas).
set -euo pipefail

root="${TEST_SRCDIR}/optimus"
run() {  # run NAME [extra flags...]
  local name=$1; shift
  timeout 300 "${root}/deploy/local/local_cluster" --bin_dir="${root}" \
    --work_dir="${TEST_TMPDIR}/${name}" --steps=300 --hidden=256 "$@" \
    >"${TEST_TMPDIR}/${name}.out" 2>"${TEST_TMPDIR}/${name}.err" || {
    echo "local_cluster (${name}) failed:"; cat "${TEST_TMPDIR}/${name}.err"
    tail -n 20 "${TEST_TMPDIR}/${name}"/*.log; exit 1; }
}

run drill --shards=3 --replication=1 --kill_shard_at_step=150
run clean --shards=3

drill=$(tail -n 1 "${TEST_TMPDIR}/drill.out")
echo "drill:  ${drill}"
echo "clean:  $(tail -n 1 "${TEST_TMPDIR}/clean.out")"
python3 - "${drill}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["steps"] == 300 and s["shard_killed_at_step"] >= 150, s
assert s["replication"] == 1, s
assert s["final_loss"] < s["initial_loss"], s
PY
coord="${TEST_TMPDIR}/drill/coord.log"
grep -q "promoted backups for" "${coord}" || {
  echo "the coordinator did not promote backups:"; cat "${coord}"; exit 1; }
if grep -q "rolled back\|job failed" "${coord}"; then
  echo "the job failed or rolled back although it had replicas:"; cat "${coord}"; exit 1
fi
# The new backups got the state from their primaries while training ran.
grep -q "new backups [1-9]" "${coord}" || {
  echo "no new backup was placed after the failover:"; cat "${coord}"; exit 1; }
if grep -h "re-joining\|resuming at step" "${TEST_TMPDIR}"/drill/worker-*.log; then
  echo "a worker had to re-join: the failover was not transparent"; exit 1
fi

cmp "${TEST_TMPDIR}/drill/params-rank0.bin" "${TEST_TMPDIR}/clean/params-rank0.bin" || {
  echo "final parameters differ from the failure-free run"; exit 1; }

sleep 0.5
if pgrep -f "${root}/(server/optimus-shard|coordinator/optimus-coord|deploy/local/optimus-train-worker)" >/dev/null; then
  echo "processes left running:"; pgrep -af "${root}/"; exit 1
fi
echo "ok: primary killed, backups promoted and re-seeded, parameters bitwise equal to the failure-free run"
