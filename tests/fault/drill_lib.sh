# Shared by the fault drills (sourced): run the local cluster, compare the
# final parameters with a reference run, and check nothing was left running.
# Needs TEST_SRCDIR and TEST_TMPDIR (bazel test sets them).

root="${TEST_SRCDIR}/optimus"

# run_cluster NAME [local_cluster flags...]: logs and outputs under
# $TEST_TMPDIR/NAME*, the JSON summary in $TEST_TMPDIR/NAME.out. Exits the
# test, with the logs, when the cluster fails.
run_cluster() {
  local name=$1; shift
  timeout 300 "${root}/deploy/local/local_cluster" --bin_dir="${root}" \
    --work_dir="${TEST_TMPDIR}/${name}" "$@" \
    >"${TEST_TMPDIR}/${name}.out" 2>"${TEST_TMPDIR}/${name}.err" || {
    echo "local_cluster (${name}) failed:"; cat "${TEST_TMPDIR}/${name}.err"
    tail -n 20 "${TEST_TMPDIR}/${name}"/*.log; exit 1; }
}

# summary NAME: the run's last stdout line (its JSON summary).
summary() { tail -n 1 "${TEST_TMPDIR}/$1.out"; }

# steps_of NAME: how many steps the run trained. A drill trains until a set
# number of steps after its event, so its reference run is given this count.
steps_of() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])["steps"])' "$(summary "$1")"; }

# same_params A B: the two runs' final parameters are the same bits.
same_params() {
  cmp "${TEST_TMPDIR}/$1/params-rank0.bin" "${TEST_TMPDIR}/$2/params-rank0.bin" || {
    echo "final parameters of $1 differ from $2"; exit 1; }
}

# no_processes_left: every process the drills started has exited.
no_processes_left() {
  sleep 0.5
  if pgrep -f "${root}/(server/optimus-shard|coordinator/optimus-coord|deploy/local/optimus-train-worker)" >/dev/null; then
    echo "processes left running:"; pgrep -af "${root}/"; exit 1
  fi
}
