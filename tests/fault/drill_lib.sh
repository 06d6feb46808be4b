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

# own_processes: pids of the optimus binaries of this tree that this test
# started. Bazel gives every test run its own TEST_TMPDIR, which the cluster's
# processes inherit, so sibling runs (--runs_per_test with parallel jobs, or
# other tests) are not counted.
own_processes() {
  local pid
  for pid in $(pgrep -f "${root}/(server/optimus-shard|coordinator/optimus-coord|deploy/local/optimus-train-worker)" || true); do
    if tr '\0' '\n' <"/proc/${pid}/environ" 2>/dev/null | grep -qxF "TEST_TMPDIR=${TEST_TMPDIR}"; then
      echo "${pid}"
    fi
  done
}

# no_processes_left: every process this test started has exited.
no_processes_left() {
  sleep 0.5
  local left
  left=$(own_processes)
  if [ -n "${left}" ]; then
    echo "processes left running:"
    for pid in ${left}; do ps -o pid=,args= -p "${pid}" || true; done
    exit 1
  fi
}

# pause_processes PID... / resume_processes PID...: stop (SIGSTOP) the
# processes and wait until each is stopped or gone; let them go on. A drill
# that chooses the last step pauses the workers first, so that the step it
# reads is not passed while it writes the stop file, however slow the shell.
pause_processes() {
  local pid state n
  for pid in "$@"; do kill -STOP "${pid}" 2>/dev/null || true; done
  for pid in "$@"; do
    for ((n = 0; n < 10000; n++)); do
      state=$(sed -E 's/.*\) ([A-Za-z]).*/\1/' "/proc/${pid}/stat" 2>/dev/null) || break
      case "${state}" in T | t | Z | X | '') break ;; esac
      sleep 0.001
    done
  done
}
resume_processes() {
  local pid
  for pid in "$@"; do kill -CONT "${pid}" 2>/dev/null || true; done
}

# skip_test MESSAGE: ends the test as skipped, saying why (a test case marked
# skipped in the XML that scripts/count_tests.py counts).
skip_test() {
  echo "SKIPPED: $1"
  if [ -n "${XML_OUTPUT_FILE:-}" ]; then
    local name msg
    name=$(basename "$0" .sh)
    msg=$(printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/"/\&quot;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g')
    cat >"${XML_OUTPUT_FILE}" <<XML
<?xml version="1.0" encoding="UTF-8"?>
<testsuites><testsuite name="${name}" tests="1" skipped="1">
<testcase name="${name}" classname="${name}"><skipped message="${msg}"/></testcase>
</testsuite></testsuites>
XML
  fi
  exit 0
}

# wait_for WHAT SECONDS COMMAND...: polls COMMAND until it succeeds; after
# SECONDS (a generous deadline, not a timing check) fails the test saying
# what it waited for, with the tail of every log of the test.
wait_for() {
  local what=$1 seconds=$2; shift 2
  local give_up=$((SECONDS + seconds))
  until "$@"; do
    if [ "${SECONDS}" -ge "${give_up}" ]; then
      echo "gave up after ${seconds}s waiting for ${what}"
      for f in $(find "${TEST_TMPDIR}" -name '*.log' -o -name '*.err' | sort); do
        echo "---- ${f}"; tail -n 15 "${f}"
      done
      exit 1
    fi
    sleep 0.2
  done
}

# ---- Network namespaces (the partition drill) ------------------------------------
# Every node (a process of the cluster) gets a namespace with one interface,
# eth0, a veth pair whose other end is on a bridge in a hub namespace; node k
# (in net_create's order) has 10.77.0.(k+1)/24. Nothing changes in the
# machine's own namespace, and names carry this shell's pid.
NET_PREFIX="optimus-drill-$$"
declare -A NET_IP=()
declare -A NET_PID=()

# require_netns: skips the test when network namespaces cannot be made.
require_netns() {
  [ "$(id -u)" = 0 ] || skip_test "needs root to make network namespaces (uid $(id -u))"
  command -v ip >/dev/null || skip_test "needs ip (iproute2) to make network namespaces"
  local out
  if ! out=$(ip netns add "${NET_PREFIX}-probe" 2>&1); then
    skip_test "cannot make a network namespace: ${out}"
  fi
  if ! out=$(ip -n "${NET_PREFIX}-probe" link add probe0 type veth peer name probe1 2>&1); then
    ip netns del "${NET_PREFIX}-probe" 2>/dev/null || true
    skip_test "cannot make a veth pair in a network namespace: ${out}"
  fi
  ip netns del "${NET_PREFIX}-probe"
}

net_ns() { echo "${NET_PREFIX}-$1"; }
net_ip() { echo "${NET_IP[$1]}"; }

# net_create NODE...: the hub with its bridge, and a namespace per node.
net_create() {
  local hub k=1 node
  hub=$(net_ns hub)
  ip netns add "${hub}"
  ip -n "${hub}" link add br0 type bridge
  ip -n "${hub}" link set br0 up
  for node in "$@"; do
    local ns
    ns=$(net_ns "${node}")
    NET_IP[${node}]="10.77.0.${k}"
    ip netns add "${ns}"
    ip -n "${hub}" link add "p-${node}" type veth peer name eth0 netns "${ns}"
    ip -n "${hub}" link set "p-${node}" master br0
    ip -n "${hub}" link set "p-${node}" up
    ip -n "${ns}" addr add "10.77.0.${k}/24" dev eth0
    ip -n "${ns}" link set eth0 up
    ip -n "${ns}" link set lo up
    k=$((k + 1))
  done
}

# net_cut A B / net_heal A B: drop, then restore, all traffic between nodes
# A and B (a blackhole route to the other in each of the two namespaces).
net_cut() {
  ip -n "$(net_ns "$1")" route add blackhole "$(net_ip "$2")/32"
  ip -n "$(net_ns "$2")" route add blackhole "$(net_ip "$1")/32"
}
net_heal() {
  ip -n "$(net_ns "$1")" route del blackhole "$(net_ip "$2")/32"
  ip -n "$(net_ns "$2")" route del blackhole "$(net_ip "$1")/32"
}

# netns_spawn NODE STDOUT STDERR COMMAND...: runs COMMAND in NODE's
# namespace in the background (ip netns exec execs it: the pid is its own).
netns_spawn() {
  local node=$1 out=$2 err=$3; shift 3
  if [ "${out}" = "${err}" ]; then
    ip netns exec "$(net_ns "${node}")" "$@" >"${out}" 2>&1 &
  else
    ip netns exec "$(net_ns "${node}")" "$@" >"${out}" 2>"${err}" &
  fi
  NET_PID[${node}]=$!
}

# netns_wait NODE SECONDS: waits for NODE's process to exit; fails (returns
# 1) if it exits with an error or is still running after SECONDS (then it is
# killed).
netns_wait() {
  local pid=${NET_PID[$1]} give_up=$((SECONDS + $2)) rc=0
  while kill -0 "${pid}" 2>/dev/null && [ "${SECONDS}" -lt "${give_up}" ]; do sleep 0.2; done
  if kill -0 "${pid}" 2>/dev/null; then
    echo "$1 (pid ${pid}) still running after $2s; killing it"
    kill -KILL "${pid}" 2>/dev/null || true
    wait "${pid}" 2>/dev/null || true
    return 1
  fi
  wait "${pid}" || rc=$?
  [ "${rc}" = 0 ] || echo "$1 (pid ${pid}) exited with status ${rc}"
  return "${rc}"
}

# netns_stop NODE: SIGTERM (a clean shutdown), SIGKILL after 15 s.
netns_stop() {
  local pid=${NET_PID[$1]} give_up=$((SECONDS + 15))
  kill -TERM "${pid}" 2>/dev/null || true
  while kill -0 "${pid}" 2>/dev/null && [ "${SECONDS}" -lt "${give_up}" ]; do sleep 0.1; done
  kill -KILL "${pid}" 2>/dev/null || true
  wait "${pid}" 2>/dev/null || true
}

# net_cleanup: kills what netns_spawn started and is still running, removes
# the namespaces (an EXIT trap).
net_cleanup() {
  local node ns
  for node in "${!NET_PID[@]}"; do
    kill -KILL "${NET_PID[${node}]}" 2>/dev/null || true
    wait "${NET_PID[${node}]}" 2>/dev/null || true
  done
  for ns in $(ip netns list | awk '{print $1}' | grep "^${NET_PREFIX}-" || true); do
    ip netns del "${ns}" 2>/dev/null || true
  done
}

# ---- etcd (the coordinators' state in etcd: the leader-kill drill) ----------------
# Debian's etcd-server; OPTIMUS_ETCD_BIN overrides where it is.
ETCD_BIN="${OPTIMUS_ETCD_BIN:-/usr/bin/etcd}"
ETCD_PIDS=()
ETCD_ENDPOINTS=""

# require_etcd: skips the test, saying why, when etcd is not installed.
require_etcd() {
  [ -x "${ETCD_BIN}" ] || skip_test "needs etcd at ${ETCD_BIN} (Debian's etcd-server; scripts/install_deps.sh installs it) to keep the coordinators' state"
}

# free_ports N: N distinct ports on 127.0.0.1 below the ephemeral range that
# nothing is bound to now, space-separated (below the range: a port a
# process listens on later must not be taken meanwhile by an outgoing
# connection's local end).
free_ports() {
  /usr/bin/python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
ports = set()
for _ in range(1000):
    if len(ports) == n:
        break
    p = random.randrange(10000, max(10001, low))
    if p in ports:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
        ports.add(p)
    except OSError:
        pass
    finally:
        s.close()
if len(ports) < n:
    sys.exit("no %d free ports below the ephemeral range" % n)
print(" ".join(str(p) for p in sorted(ports)))
PY
}

# etcd_healthy PORT: the member answering on client port PORT says it is
# healthy (its /health: a leader elected, the member in the quorum).
etcd_healthy() {
  /usr/bin/python3 - "$1" <<'PY' 2>/dev/null
import json, sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:%s/health" % sys.argv[1], timeout=2) as r:
    sys.exit(0 if json.loads(r.read()).get("health") in ("true", True) else 1)
PY
}

# etcd_start N: an etcd cluster of N members on loopback (data and logs
# under $TEST_TMPDIR/etcd-K), waits until every member is healthy, and sets
# ETCD_ENDPOINTS to their client addresses (HOST:PORT,...). etcd_stop (an
# EXIT trap) ends them.
etcd_start() {
  local n=$1 k ports cluster="" client peer
  read -r -a ports <<<"$(free_ports $((2 * n)))"
  for ((k = 0; k < n; k++)); do
    cluster="${cluster}${cluster:+,}etcd-${k}=http://127.0.0.1:${ports[$((2 * k + 1))]}"
  done
  ETCD_ENDPOINTS=""
  for ((k = 0; k < n; k++)); do
    client=${ports[$((2 * k))]}
    peer=${ports[$((2 * k + 1))]}
    mkdir -p "${TEST_TMPDIR}/etcd-${k}"
    # A longer election timeout than the default 1 s: on a loaded 2-core
    # machine a member's heartbeats can be late by that much, and an etcd
    # election is not what this drill is about.
    "${ETCD_BIN}" --name "etcd-${k}" --data-dir "${TEST_TMPDIR}/etcd-${k}/data" \
      --listen-client-urls "http://127.0.0.1:${client}" \
      --advertise-client-urls "http://127.0.0.1:${client}" \
      --listen-peer-urls "http://127.0.0.1:${peer}" \
      --initial-advertise-peer-urls "http://127.0.0.1:${peer}" \
      --initial-cluster "${cluster}" --initial-cluster-state new \
      --initial-cluster-token "optimus-drill-$$" \
      --heartbeat-interval 100 --election-timeout 2500 \
      >"${TEST_TMPDIR}/etcd-${k}.log" 2>&1 &
    ETCD_PIDS+=("$!")
    ETCD_ENDPOINTS="${ETCD_ENDPOINTS}${ETCD_ENDPOINTS:+,}127.0.0.1:${client}"
  done
  for ((k = 0; k < n; k++)); do
    wait_for "etcd member ${k} healthy" 60 etcd_healthy "${ports[$((2 * k))]}"
  done
  echo "etcd: ${n} members, clients at ${ETCD_ENDPOINTS}"
}

etcd_stop() {
  local pid
  for pid in "${ETCD_PIDS[@]}"; do kill -TERM "${pid}" 2>/dev/null || true; done
  for pid in "${ETCD_PIDS[@]}"; do wait "${pid}" 2>/dev/null || true; done
  ETCD_PIDS=()
}
