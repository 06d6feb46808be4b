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

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"
run() {  # run NAME [extra flags...]
  local name=$1; shift
  run_cluster "${name}" --steps=300 --hidden=256 "$@"
}

run drill --shards=3 --replication=1 --kill_shard_at_step=150
run clean --shards=3 --steps="$(steps_of drill)"

drill=$(tail -n 1 "${TEST_TMPDIR}/drill.out")
echo "drill:  ${drill}"
echo "clean:  $(tail -n 1 "${TEST_TMPDIR}/clean.out")"
python3 - "${drill}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["steps"] >= 300 and s["shard_killed_at_step"] >= 150, s
assert s["shard_killed_at_step"] < s["steps"], s
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

same_params drill clean

# Eight shards: the failover's new epoch changes the parts of the shards
# that held the killed shard's chunks or take them over, not the others'.
# Those take the epoch without fetching the map (Assignment.part_epoch),
# the workers get only the moved chunks (a map delta), and training still
# ends bitwise where a failure-free run does.
run wide --shards=8 --replication=1 --kill_shard_at_step=150
if [[ "$(steps_of wide)" != "$(steps_of clean)" ]]; then
  run clean_wide --shards=3 --steps="$(steps_of wide)"
  same_params wide clean_wide
else
  same_params wide clean
fi
unchanged=$(grep -l "part unchanged since epoch 1" "${TEST_TMPDIR}"/wide/shard-*.log | wc -l)
fetched=$(grep -l "map epoch 1 -> 2 ([0-9]* new chunks" "${TEST_TMPDIR}"/wide/shard-*.log | wc -l)
echo "wide: ${unchanged} shards took the failover's epoch without a fetch, ${fetched} fetched it"
[[ "${unchanged}" -ge 1 ]] || {
  echo "every shard fetched the failover's map, though some parts did not change:"
  grep -h "map epoch" "${TEST_TMPDIR}"/wide/shard-*.log; exit 1; }
[[ "${fetched}" -ge 1 ]] || { echo "no shard fetched the failover's map"; exit 1; }
if grep -h "re-joining\|resuming at step" "${TEST_TMPDIR}"/wide/worker-*.log; then
  echo "a worker had to re-join (wide)"; exit 1
fi
# The workers got the chunks that moved (a delta from the epoch they held),
# not the whole map again.
for w in "${TEST_TMPDIR}"/wide/worker-*.log; do
  grep -q "map epoch 1 -> 2 from a delta of" "${w}" || {
    echo "worker $(basename "${w}") did not take the failover's map as a delta:"
    grep -h "map epoch" "${w}"; exit 1; }
done

no_processes_left
echo "ok: primary killed, backups promoted and re-seeded, parameters bitwise equal to the failure-free run; shards whose part did not change took the new epoch without a fetch"
