#!/usr/bin/env bash
# Partition drill, real processes in network namespaces on one machine: the
# coordinator, three shard servers and two workers each get a namespace of
# their own, joined by veth pairs to a bridge (UCX over TCP between them,
# gRPC to the coordinator over the same bridge). A replicated job
# (replication 1) trains. Then one shard that is the primary of some chunks
# is cut off from the coordinator only (a blackhole route each way): the
# workers and the other shards still reach it, and it still runs.
#
# What must happen: its lease expires, the coordinator marks it down and
# promotes the backups of its chunks; it stops publishing (a primary
# publishes a version only once its backup has taken the step, and the
# promoted backup fences it); no version of any chunk is ever made twice
# with different bytes, and no version is published by two primaries (every
# shard logs each chunk version it makes with a CRC of its published copy,
# optimus-shard --audit_versions); the job goes on without a worker
# re-joining. When the partition heals the shard learns it was declared
# down, drops its stale chunks and registers again. The final parameters,
# and every version made on the way, are bitwise those of the same training
# without the partition.
#
# Ordered by observed steps and log lines, never by sleeps; every wait has a
# generous deadline. Skips (saying why) when network namespaces cannot be
# made: not root, no `ip` (iproute2), or no CAP_SYS_ADMIN.
set -euo pipefail

source "${TEST_SRCDIR}/optimus/tests/fault/drill_lib.sh"

require_netns

# The same knobs for both runs.
HIDDEN=256
WORKERS=2
SHARDS=3
CUT_AT_STEP=30          # cut once rank 0 has reported this step
STEPS_AFTER_FAILOVER=30  # train this many steps on the new primaries before healing
DEADLINE_S=240          # for any one thing the drill waits for

# gRPC would send 10.77.0.1 through a proxy from the environment.
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY grpc_proxy all_proxy ALL_PROXY

nodes=(coord)
for ((i = 0; i < SHARDS; i++)); do nodes+=("s${i}"); done
for ((r = 0; r < WORKERS; r++)); do nodes+=("w${r}"); done
net_create "${nodes[@]}"
trap 'net_cleanup' EXIT

# run_netns_cluster NAME WORKER_FLAGS...: starts the coordinator, the shards
# and the workers of run NAME in their namespaces (logs under
# $TEST_TMPDIR/NAME); returns once all are started.
run_netns_cluster() {
  local name=$1; shift
  local dir="${TEST_TMPDIR}/${name}"
  mkdir -p "${dir}"
  netns_spawn coord "${dir}/coord.log" "${dir}/coord.log" "${root}/coordinator/optimus-coord" \
    --listen="$(net_ip coord):0" --port_file="${dir}/coord.port" --lease_ms=2000 \
    --state_dir="${dir}/coord-state"
  wait_for "${name}: optimus-coord listening" "${DEADLINE_S}" test -s "${dir}/coord.port"
  local coord_addr
  coord_addr="$(net_ip coord):$(cat "${dir}/coord.port")"
  for ((i = 0; i < SHARDS; i++)); do
    netns_spawn "s${i}" "${dir}/shard-${i}.log" "${dir}/shard-${i}.log" "${root}/server/optimus-shard" \
      --coordinator="${coord_addr}" --kind=host --transports=tcp --net_devices=eth0 \
      --memory_limit_mb=512 --audit_versions
  done
  for ((i = 0; i < SHARDS; i++)); do
    wait_for "${name}: shard ${i} registered" "${DEADLINE_S}" \
      log_has "${dir}/shard-${i}.log" "registered shard_id="
  done
  for ((r = 0; r < WORKERS; r++)); do
    local extra=()
    [ "${r}" = 0 ] && extra+=(--params_out="${dir}/params-rank0.bin")
    netns_spawn "w${r}" "${dir}/worker-${r}.out" "${dir}/worker-${r}.log" \
      "${root}/deploy/local/optimus-train-worker" \
      --coordinator="${coord_addr}" --rank="${r}" --world_size="${WORKERS}" \
      --hidden="${HIDDEN}" --seed=1 --replication=1 --transports=tcp --net_devices=eth0 \
      "${extra[@]}" "$@"
  done
}

# log_has FILE REGEX: FILE exists and has a line matching REGEX.
log_has() { grep -qE "$2" "$1" 2>/dev/null; }

# step_of NAME: the last step rank 0 of run NAME reported (0 before any).
step_of() {
  local s
  s=$(grep '"event": "step".*}$' "${TEST_TMPDIR}/$1/worker-0.out" 2>/dev/null | tail -n 1 |
      sed -E 's/.*"step": ([0-9]+).*/\1/') || true
  echo "${s:-0}"
}
step_at_least() { [ "$(step_of "$1")" -ge "$2" ]; }

# finish_run NAME: waits for the workers to exit (each must succeed), then
# stops the shards and the coordinator as an operator would (SIGTERM).
finish_run() {
  local name=$1 r
  for ((r = 0; r < WORKERS; r++)); do
    netns_wait "w${r}" "${DEADLINE_S}" || {
      echo "${name}: worker ${r} failed:"; tail -n 30 "${TEST_TMPDIR}/${name}/worker-${r}.log"
      exit 1; }
  done
  for ((i = 0; i < SHARDS; i++)); do netns_stop "s${i}"; done
  netns_stop coord
}

# ---- The drill ----------------------------------------------------------------
D="${TEST_TMPDIR}/drill"
run_netns_cluster drill --steps=1000000 --stop_file="${D}/stop-after-step"
wait_for "drill: training reached step ${CUT_AT_STEP}" "${DEADLINE_S}" \
  step_at_least drill "${CUT_AT_STEP}"

# The victim: a shard that has published a chunk version as its primary.
victim=""
for ((i = 0; i < SHARDS; i++)); do
  if grep -q "audit: made .* role=primary" "${D}/shard-${i}.log"; then victim=$i; break; fi
done
[ -n "${victim}" ] || { echo "no shard published anything as a primary"; exit 1; }
victim_id=$(grep -m1 -o "registered shard_id=[0-9]*" "${D}/shard-${victim}.log" | cut -d= -f2)
cut_step=$(step_of drill)
net_cut "s${victim}" coord
echo "drill: cut shard ${victim} (id ${victim_id}) off from the coordinator at step ${cut_step}"

wait_for "the coordinator to mark shard ${victim_id} down and promote its backups" "${DEADLINE_S}" \
  log_has "${D}/coord.log" "shard ${victim_id} lost; promoted backups for [1-9]"
failover_step=$(step_of drill)
echo "drill: backups of shard ${victim_id} promoted; rank 0 at step ${failover_step}"
wait_for "training to go on ${STEPS_AFTER_FAILOVER} steps on the new primaries" "${DEADLINE_S}" \
  step_at_least drill "$((failover_step + STEPS_AFTER_FAILOVER))"

net_heal "s${victim}" coord
heal_step=$(step_of drill)
echo "drill: partition healed at step ${heal_step}"
wait_for "shard ${victim} to learn it was declared down and register again" "${DEADLINE_S}" \
  log_has "${D}/shard-${victim}.log" "coordinator no longer knows shard_id=${victim_id}"
registered_again() { [ "$(grep -c 'registered shard_id=' "${D}/shard-${victim}.log")" -ge 2 ]; }
wait_for "shard ${victim} registered under a new id" "${DEADLINE_S}" registered_again
# End a set number of steps later (ahead of every worker: they are at most a
# step apart), written atomically, with the workers paused meanwhile: a
# loaded machine can take longer than 20 steps between reading the step and
# writing the file (a run failed that way: "asks to stop after step 212 but
# step 241 is under way").
workers=()
for ((r = 0; r < WORKERS; r++)); do workers+=("${NET_PID[w${r}]}"); done
pause_processes "${workers[@]}"
final_steps=$(($(step_of drill) + 20))
echo "${final_steps}" >"${D}/stop-after-step.tmp"
mv "${D}/stop-after-step.tmp" "${D}/stop-after-step"
resume_processes "${workers[@]}"
finish_run drill
echo "drill: trained ${final_steps} steps"

# ---- The same training without the partition ------------------------------------
run_netns_cluster clean --steps="${final_steps}"
finish_run clean

# ---- Checks -----------------------------------------------------------------------
grep -q "shard down id=${victim_id} " "${D}/coord.log" || {
  echo "the coordinator never marked shard ${victim_id} down:"; cat "${D}/coord.log"; exit 1; }
grep -q "heartbeat failed" "${D}/shard-${victim}.log" || {
  echo "shard ${victim}'s heartbeats never failed: the cut did not cut"; exit 1; }
if grep -h "re-joining\|resuming at step" "${D}"/worker-*.log; then
  echo "a worker had to re-join: the failover was not transparent"; exit 1
fi
if grep -q "job failed\|rolled back" "${D}/coord.log"; then
  echo "the job failed or rolled back although it had replicas:"; cat "${D}/coord.log"; exit 1
fi
fenced=$(grep -c "retired: fenced by shard" "${D}/shard-${victim}.log" || true)
echo "drill: shard ${victim} had ${fenced} chunk(s) fenced by their promoted backups"

/usr/bin/python3 - "${D}" "${TEST_TMPDIR}/clean" "${SHARDS}" "${victim}" "${final_steps}" <<'PY'
import collections, re, sys
drill, clean, shards, victim, final_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
pat = re.compile(r"audit: made job=\d+ tensor=(\d+) chunk=(\d+) version=(\d+) role=(\w+) crc32c=([0-9a-f]{8})")

def made(run):
    """shard index -> list of ((tensor, chunk), version, role, crc)."""
    out = {}
    for i in range(shards):
        rows = []
        with open(f"{run}/shard-{i}.log", errors="replace") as f:
            for line in f:
                m = pat.search(line)
                if m:
                    rows.append(((int(m[1]), int(m[2])), int(m[3]), m[4], m[5]))
        out[i] = rows
    return out

d, c = made(drill), made(clean)
# 1. Every version of every chunk, wherever it was made (primary, backup,
#    old or new primary), has one set of bytes: the failure-free run's.
crcs = collections.defaultdict(set)
primaries = collections.defaultdict(set)
for i, rows in d.items():
    for key, v, role, crc in rows:
        crcs[(key, v)].add(crc)
        if role == "primary":
            primaries[(key, v)].add(i)
ref = {}
for rows in c.values():
    for key, v, role, crc in rows:
        if role == "primary":
            ref[(key, v)] = crc
split = {k: s for k, s in crcs.items() if len(s) > 1}
assert not split, f"versions made with different bytes: {sorted(split.items())[:10]}"
twice = {k: s for k, s in primaries.items() if len(s) > 1}
assert not twice, f"versions published by two primaries (shards): {sorted(twice.items())[:10]}"
differ = {k: (s, ref.get(k)) for k, s in crcs.items() if ref.get(k) not in s}
assert not differ, f"versions unlike the failure-free run's (drill, clean): {sorted(differ.items())[:10]}"
# 2. The cut-off primary stopped publishing: each of its chunks was then
#    published by another shard only, from a later version on.
mine = collections.defaultdict(list)
for key, v, role, _ in d[victim]:
    if role == "primary":
        mine[key].append(v)
assert mine, "the victim published nothing as a primary"
for key, versions in sorted(mine.items()):
    after = [v for i, rows in d.items() if i != victim
             for k, v, role, _ in rows if k == key and role == "primary"]
    assert after, f"chunk {key}: nobody took over from the cut-off primary"
    assert max(versions) < min(after), (
        f"chunk {key}: the cut-off primary published up to version {max(versions)}, "
        f"its successor from {min(after)}")
    assert max(after) == final_steps + 1, (key, max(after), final_steps)
    print(f"chunk {key}: cut-off primary published versions {min(versions)}..{max(versions)}, "
          f"its successor {min(after)}..{max(after)}")
print(f"{len(crcs)} chunk versions made in the drill, all bitwise equal to the failure-free run's; "
      f"{len(primaries)} published, each by one primary")
PY

same_params drill clean
echo "ok: shard ${victim} cut off from the coordinator at step ${cut_step}, fenced, its backups promoted; it stopped publishing, no version made twice with different bytes, parameters bitwise equal to the failure-free run"
