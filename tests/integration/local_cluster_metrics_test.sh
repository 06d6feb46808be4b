#!/usr/bin/env bash
# On a running local cluster (real optimus-coord, optimus-shard and worker
# processes), scrapes /metrics of the coordinator and of a shard twice while
# training runs: every metric an operator watches is there, and the counters
# that follow training move between the two scrapes. /healthz answers ok.
set -euo pipefail

root="${TEST_SRCDIR}/optimus"
work="${TEST_TMPDIR}/cluster"
# Three consecutive free ports below the kernel's ephemeral range (where
# other processes' outgoing connections and port-0 listeners get theirs).
base=$(python3 - <<'PY'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(200):
    base = random.randrange(10000, low - 8)
    socks = []
    try:
        for p in range(base, base + 3):
            s = socket.socket()
            s.bind(("0.0.0.0", p))
            socks.append(s)
        print(base)
        break
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()
PY
)

# Training runs until this test has scraped twice (then it creates the file).
stop="${TEST_TMPDIR}/stop"
"${root}/deploy/local/local_cluster" --bin_dir="${root}" --work_dir="${work}" \
  --steps=400 --hidden=128 --metrics_port="${base}" --stop_when_file="${stop}" \
  >"${TEST_TMPDIR}/out.txt" 2>"${TEST_TMPDIR}/err.txt" &
cluster=$!
on_exit() {
  rc=$?
  kill ${cluster} 2>/dev/null || true
  if [ "${rc}" -ne 0 ]; then
    echo "local_cluster's output:"; tail -n 30 "${TEST_TMPDIR}/err.txt"
    tail -n 15 "${work}"/*.log 2>/dev/null || true
  fi
}
trap on_exit EXIT

# What the binaries say they are: optimus_build_info must say the same.
coord_version="$("${root}/coordinator/optimus-coord" --version)"
shard_version="$("${root}/server/optimus-shard" --version)"

python3 - "${base}" "${cluster}" "${stop}" "${coord_version}" "${shard_version}" <<'PY'
import os, re, sys, time, urllib.request

base, cluster, stop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
coord_version, shard_version = sys.argv[4].split(), sys.argv[5].split()
coord, shard = f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"

def get(url):
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status, r.read().decode()

def alive():
    try:
        os.kill(cluster, 0)
        return True
    except OSError:
        return False

def scrape(url):
    _, text = get(url + "/metrics")
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        values[name_labels] = float(value)
    return values

def total(values, name):
    return sum(v for k, v in values.items() if re.match(re.escape(name) + r"(\{|$)", k))

# Wait until training is under way (the shard has applied steps).
deadline = time.time() + 120
first = None
while time.time() < deadline and alive():
    try:
        s = scrape(shard)
        if total(s, "optimus_shard_steps_total") > 0:
            first = (scrape(coord), s)
            break
    except OSError:
        pass
    time.sleep(0.2)
assert first is not None, "no shard steps seen on /metrics before training ended"
# The second scrape once the coordinator has heard of more steps (heartbeats
# lag the data plane), rather than after a fixed pause: on a fast machine
# the counters might not have moved yet on a slow one. Training goes on until
# this test creates the stop file.
deadline = time.time() + 120
second = None
while time.time() < deadline:
    assert alive(), "training ended before the counters moved"
    second = (scrape(coord), scrape(shard))
    if (total(second[0], "optimus_coord_job_step") > total(first[0], "optimus_coord_job_step")
            and total(second[1], "optimus_shard_steps_total")
            > total(first[1], "optimus_shard_steps_total")):
        break
    time.sleep(0.1)

shard_metrics = ["optimus_shard_step_seconds_count", "optimus_shard_steps_total",
                 "optimus_shard_optimizer_params_total", "optimus_shard_pushed_bytes_total",
                 "optimus_shard_pulled_bytes_total", "optimus_shard_memory_used_bytes",
                 "optimus_shard_memory_limit_bytes", "optimus_shard_chunks_owned",
                 "optimus_shard_lease_age_seconds"]
coord_metrics = ["optimus_coord_shards", "optimus_coord_shard_up",
                 "optimus_coord_shard_lease_age_seconds", "optimus_coord_shard_memory_used_bytes",
                 "optimus_coord_shard_chunks_owned", "optimus_coord_job_step",
                 "optimus_coord_job_state_bytes"]
for name in shard_metrics:
    assert any(re.match(re.escape(name) + r"(\{|$)", k) for k in second[1]), f"shard lacks {name}"
for name in coord_metrics:
    assert any(re.match(re.escape(name) + r"(\{|$)", k) for k in second[0]), f"coordinator lacks {name}"
_, shard_text = get(shard + "/metrics")
assert "# TYPE optimus_shard_errors_total counter" in shard_text, "shard lacks errors by kind"
# Which release runs, as --version prints it ("optimus-coord 0.1.0").
for values, (binary, version) in ((second[0], coord_version), (second[1], shard_version)):
    info = [k for k, v in values.items() if k.startswith("optimus_build_info{") and v == 1]
    assert len(info) == 1, f"{binary}: optimus_build_info is {info}"
    assert f'version="{version}"' in info[0] and f'binary="{binary}"' in info[0], info[0]
    print(info[0])
# The per-job label is job_name (a "job" label would clash with the scrape job's).
job_series = [k for k in second[0] if k.startswith("optimus_coord_job_step{")]
assert job_series and all(re.match(r'optimus_coord_job_step\{job_name="[^"]+"\}$', k)
                          for k in job_series), job_series

for name in ["optimus_shard_steps_total", "optimus_shard_optimizer_params_total",
             "optimus_shard_pushed_bytes_total", "optimus_shard_pulled_bytes_total",
             "optimus_shard_step_seconds_count"]:
    a, b = total(first[1], name), total(second[1], name)
    assert b > a, f"{name} did not move while training ran: {a} -> {b}"
    print(f"{name}: {a:.0f} -> {b:.0f}")
a, b = total(first[0], "optimus_coord_job_step"), total(second[0], "optimus_coord_job_step")
assert b > a, f"optimus_coord_job_step did not move: {a} -> {b}"
print(f"optimus_coord_job_step: {a:.0f} -> {b:.0f}")
assert total(second[1], "optimus_shard_memory_used_bytes") > 0
assert total(second[1], "optimus_shard_chunks_owned") > 0
for url in (coord, shard):
    status, body = get(url + "/healthz")
    assert status == 200, (url, status, body)
print("metrics ok")
open(stop, "w").close()  # Training may end now.
PY

wait "${cluster}" || { echo "local_cluster failed:"; cat "${TEST_TMPDIR}/err.txt"; exit 1; }
trap - EXIT
tail -n 1 "${TEST_TMPDIR}/out.txt"
