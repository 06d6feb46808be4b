#!/usr/bin/env bash
# Runs the main job (optimus-local-cluster) briefly and checks what a user
# sees: training lowers the loss, the result matches torch::optim::AdamW, the
# last line is the JSON summary, and no optimus process is left running.
set -euo pipefail

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"
out="${TEST_TMPDIR}/out.txt"
work="${TEST_TMPDIR}/cluster"

"${root}/deploy/local/local_cluster" --bin_dir="${root}" --work_dir="${work}" \
  --steps=60 --hidden=64 >"${out}" 2>"${TEST_TMPDIR}/err.txt" || {
  echo "local_cluster failed:"; cat "${TEST_TMPDIR}/err.txt"; cat "${out}"; exit 1; }

last=$(tail -n 1 "${out}")
echo "summary: ${last}"
python3 - "${last}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
assert s["summary"] == "local_cluster", s
assert s["workers"] == 2 and s["shards"] == 2 and s["steps"] == 60, s
assert s["final_loss"] < s["initial_loss"], s
assert s["max_abs_diff_vs_local_adamw"] <= 1e-2, s
assert s["step_ms_median"] > 0, s
PY

# Progress was shown while training.
grep -q "step 60/60" "${TEST_TMPDIR}/err.txt" || { echo "no progress line"; exit 1; }

# Nothing left behind: no process this test started still runs.
no_processes_left
echo "ok"
