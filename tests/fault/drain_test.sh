#!/usr/bin/env bash
# Drain during training, real processes on loopback: at step 80 shard 0 is
# drained (the DrainShard RPC that `optimusctl drain` calls) while the two
# workers keep training; once the coordinator reports it holds no chunk, it
# is stopped. With replication 0 its chunks first get a temporary backup,
# seeded by the primary, which is then promoted; with replication 1 their
# backups are promoted and new ones seeded. No step is lost: the final
# parameters are bitwise those of a run that was never drained.
set -euo pipefail

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"
run() {  # run NAME [extra flags...]
  local name=$1; shift
  run_cluster "${name}" --steps=250 --hidden=256 --shards=3 "$@"
}

run drain0 --drain_shard_at_step=80
run drain1 --drain_shard_at_step=80 --replication=1

for d in drain0 drain1; do
  # The same training without a drain, as many steps as the drill ran.
  run "clean-${d}" --steps="$(steps_of "${d}")"
  echo "clean:  $(summary "clean-${d}")"
  line=$(summary "${d}")
  echo "${d}: ${line}"
  python3 - "${line}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["steps"] >= 250 and s["drain_started_at_step"] >= 80, s
# The drained shard was stopped while training still ran.
assert 0 < s["drained_at_step"] < s["steps"], s
assert s["final_loss"] < s["initial_loss"], s
PY
  coord="${TEST_TMPDIR}/${d}/coord.log"
  grep -q "drained: it holds no chunk" "${coord}" || {
    echo "${d}: the coordinator never reported the shard drained:"; cat "${coord}"; exit 1; }
  if grep -q "job failed\|rolled back" "${coord}"; then
    echo "${d}: the job failed during the drain:"; cat "${coord}"; exit 1
  fi
  if grep -h "re-joining\|resuming at step" "${TEST_TMPDIR}/${d}"/worker-*.log; then
    echo "${d}: a worker had to re-join"; exit 1
  fi
  same_params "${d}" "clean-${d}"
done
grep -q "placed 1 temporary\|placed [1-9][0-9]* temporary" "${TEST_TMPDIR}/drain0/coord.log" || {
  echo "drain0: no temporary backup was placed:"; cat "${TEST_TMPDIR}/drain0/coord.log"; exit 1; }

no_processes_left
echo "ok: shard drained and stopped during training (replication 0 and 1), parameters bitwise equal"
