#!/usr/bin/env bash
# Coordinator outage drill, real processes on loopback: optimus-coord is
# killed (SIGKILL) at step 20 and stays down for OPTIMUS_DRILL_OUTAGE_S
# seconds (default 180: three minutes), then comes back from the same
# --state_dir. Meanwhile the kubelet is emulated with the Helm chart's probe
# settings (tests/fault/kubelet_probes.py reads shard.livenessProbe and
# shard.readinessProbe from deploy/helm/optimus/values.yaml): every shard's
# /healthz and /readyz are probed with the chart's delay, period, timeout
# and failure threshold, and a shard whose liveness fails that many times in
# a row is "restarted" (killed), as Kubernetes would.
#
# What must happen: no shard is restarted (liveness answers from the
# shard's own state, whatever the coordinator's), training goes on through
# the whole outage (steps advance in its first and in its second half), the
# shards turn not ready (the chart's readiness: no heartbeat answered within
# the lease), the returned coordinator recovers the shards and the job, and
# the job ends with the parameters of a run without the outage, bit for bit.
#
# Workers pace their steps (--worker_min_step_ms, same results) so that
# three minutes of training are about two thousand steps, whatever the
# machine's speed. Shorter, for a quick look:
#   bazel test //tests/fault:coordinator_outage_drill_test --test_env=OPTIMUS_DRILL_OUTAGE_S=20
set -euo pipefail

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"

OUTAGE_S=${OPTIMUS_DRILL_OUTAGE_S:-180}
PACE_MS=100
SHARDS=2
case "${OUTAGE_S}" in
  '' | *[!0-9]*) echo "OPTIMUS_DRILL_OUTAGE_S must be a whole number of seconds, got '${OUTAGE_S}'"; exit 2 ;;
esac
[ "${OUTAGE_S}" -ge 10 ] || { echo "OPTIMUS_DRILL_OUTAGE_S must be at least 10 (got ${OUTAGE_S})"; exit 2; }
# Enough steps that the workers' cap (10x --steps in a drill) is never
# reached during the outage, however fast the machine.
steps=$((OUTAGE_S * 1000 / PACE_MS / 5))
[ "${steps}" -ge 200 ] || steps=200

# Ports below the ephemeral range (an outgoing connection may take a port
# of the ephemeral range while the coordinator is down, and the restart could
# not listen on it): the coordinator's gRPC port, its metrics port, then one
# metrics port per shard (local_cluster --metrics_port).
base_port=$(/usr/bin/python3 - "${SHARDS}" <<'PY'
import random, socket, sys
n = int(sys.argv[1]) + 2
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    base = random.randrange(10000, max(10001, low - n))
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket()
            s.bind(("0.0.0.0", p))
            socks.append(s)
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(base)
    break
else:
    sys.exit("no free range of ports below the ephemeral range")
PY
)
coord_port=${base_port}
base_port=$((base_port + 1))
ports=$(seq -s, $((base_port + 1)) $((base_port + SHARDS)))

D="${TEST_TMPDIR}/drill"
echo "drill: coordinator down ${OUTAGE_S}s from step 20; shards' metrics on ports ${ports}"
timeout $((OUTAGE_S + 600)) "${root}/deploy/local/local_cluster" --bin_dir="${root}" \
  --work_dir="${D}" --shards="${SHARDS}" --hidden=64 --steps="${steps}" \
  --kill_coordinator_at_step=20 --coordinator_down_ms=$((OUTAGE_S * 1000)) \
  --coordinator_port="${coord_port}" --metrics_port="${base_port}" \
  --worker_min_step_ms="${PACE_MS}" \
  >"${TEST_TMPDIR}/drill.out" 2>"${TEST_TMPDIR}/drill.err" &
cluster=$!
/usr/bin/python3 "${root}/tests/fault/kubelet_probes.py" \
  --values="${root}/deploy/helm/optimus/values.yaml" --ports="${ports}" \
  --until_pid="${cluster}" --events="${TEST_TMPDIR}/drill.err" \
  --out="${TEST_TMPDIR}/probes.json" 2>"${TEST_TMPDIR}/probes.err" &
prober=$!
rc=0
wait "${cluster}" || rc=$?
wait "${prober}" || { echo "the probe emulator failed:"; cat "${TEST_TMPDIR}/probes.err"; exit 1; }
cat "${TEST_TMPDIR}/probes.err"
if [ "${rc}" != 0 ]; then
  echo "local_cluster (drill) failed (status ${rc}):"; cat "${TEST_TMPDIR}/drill.err"
  tail -n 20 "${D}"/*.log; exit 1
fi

drill=$(summary drill)
echo "drill:  ${drill}"
/usr/bin/python3 - "${drill}" "${TEST_TMPDIR}/probes.json" "${OUTAGE_S}" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
p = json.load(open(sys.argv[2]))
outage_s = int(sys.argv[3])
live = p["settings"]["livenessProbe"]
print(f"probes (chart settings): liveness every {live['periodSeconds']:g}s, timeout "
      f"{live['timeoutSeconds']:g}s, restart after {live['failureThreshold']} failures; "
      f"readiness {p['settings']['readinessProbe']}")
assert p["shards_found"] == p["shards_expected"], f"probed {p['shards_found']} of {p['shards_expected']} shards"
# No shard restarted by its liveness probe.
assert not p["restarted_by_liveness"], f"shards restarted by the liveness probe: {p['restarted_by_liveness']}"
# The outage lasted as long as asked (seen from the launcher's own lines).
# The kill and the restart are seen in the launcher's log, polled every
# 0.2 s: the gap seen may fall short of the real one by up to that twice.
assert p["outage_seconds_seen"] is not None and p["outage_seconds_seen"] >= outage_s - 0.5, p["outage_seconds_seen"]
for sh in p["shards"]:
    l, r = sh["livenessProbe"], sh["readinessProbe"]
    down_l = l["by_phase"].get("down", {"ok": 0, "failed": 0})
    down_r = r["by_phase"].get("down", {"ok": 0, "failed": 0})
    print(f"shard {sh['index']}: liveness {l['probes']} probes, {l['failures']} failed "
          f"(during the outage {down_l['ok']} ok, {down_l['failed']} failed); readiness "
          f"{r['probes']} probes, transitions {r['transitions']}")
    # Probed all through the outage, and alive every time.
    assert down_l["ok"] >= int(outage_s // live["periodSeconds"]) - 2, (sh["index"], down_l)
    assert down_l["failed"] == 0, (sh["index"], l)
    # Not ready while the coordinator was away (the chart's readiness).
    assert any(not t["ready"] and t["phase"] == "down" for t in r["transitions"]), (sh["index"], r)
# Training went on through the whole outage: steps advanced in its first
# half and in its second half.
down = [x for x in p["samples"] if x["phase"] == "down"]
assert len(down) >= 3, p["samples"]
first, mid, last = down[0]["step"], down[len(down) // 2]["step"], down[-1]["step"]
print(f"steps during the outage: {first} -> {mid} -> {last}; killed at step "
      f"{s['coordinator_killed_at_step']}, back at step {s['coordinator_restarted_at_step']}, "
      f"{s['steps']} steps in all")
assert first < mid < last, (first, mid, last)
assert s["coordinator_restarted_at_step"] > s["coordinator_killed_at_step"], s
assert s["coordinator_restarted_at_step"] < s["steps"], s
assert s["final_loss"] < s["initial_loss"], s
PY
grep -q "recovered state from" "${D}/coord-restarted.log" || {
  echo "the returned coordinator did not load its state:"; cat "${D}/coord-restarted.log"; exit 1; }
if grep -h "re-joining\|resuming at step" "${D}"/worker-*.log; then
  echo "a worker had to re-join during the outage"; exit 1
fi

# The same training without the outage (no pacing: the same bits).
run_cluster clean --shards="${SHARDS}" --hidden=64 --steps="$(steps_of drill)"
echo "clean:  $(summary clean)"
same_params drill clean

no_processes_left
echo "ok: coordinator down ${OUTAGE_S}s under the chart's probes: no shard restarted, training went on, parameters bitwise equal to the run without the outage"
