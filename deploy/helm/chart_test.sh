#!/usr/bin/env bash
# Tests the optimus Helm chart with no cluster and no helm binary:
#   1. builds deploy/helm/render (Go text/template + sprig, Helm's functions);
#   2. renders the chart with seven value sets: default, DPU-only
#      (optimus/ci/dpu-only-values.yaml), host-only (optimus/ci/host-only-values.yaml),
#      everything on (optimus/ci/full-values.yaml: PrometheusRule,
#      NetworkPolicies, TLS test hook), plain text (tests/values/plaintext-values.yaml),
#      etcd mode with the chart's etcd (optimus/ci/etcd-values.yaml: two
#      coordinators, a 3-member etcd StatefulSet) and over an external etcd
#      (tests/values/etcd-external-values.yaml);
#   3. validates each rendering with tests/validate.js: YAML without duplicate
#      keys, every object against the Kubernetes API schemas (PrometheusRule and
#      ServiceMonitor against the Prometheus Operator's), the merged values
#      against values.schema.json, and what a user would notice (DaemonSets only
#      for the enabled kinds, probes on /healthz at the metrics port,
#      nodeSelector/tolerations from values, selectors that select, alerts on
#      metrics the real binaries export with the values' thresholds, who the
#      NetworkPolicies let reach which port, the test pod's optimusctl
#      command); strict_fields.py then rejects fields the Kubernetes API does
#      not define;
#   4. runs every rendered flag file through the real binary
#      (optimus-shard / optimus-coord --flagfile=F --version), which rejects
#      unknown flags and bad values;
#   5. runs the `helm test` pod's command (the real optimusctl) against a real
#      optimus-coord, plain text and TLS with an admin certificate from
#      scripts/make_local_ca.sh: it passes, and fails with a trainer's
#      certificate (no status role) or with the coordinator down;
#   6. checks that it fails when it should: a missing required value, a memory
#      limit below the state budget, a NetworkPolicy that would cut off
#      hostNetwork shards, a TLS test hook without an admin Secret, a bad alert
#      selector or port range, values the schema rejects, and broken manifests
#      (wrong probe path, duplicate key, bad field type, misspelt field, an
#      alert on a metric nobody exports, a policy that shuts out the shards, a
#      test hook without its certificate, unknown flag).
# Needs golang-go, golang-github-masterminds-sprig-dev, golang-gopkg-yaml.v3-dev,
# nodejs, python3-kubernetes, openssl and deploy/helm/tests/node_modules (scripts/install_deps.sh
# installs them all); fails saying what is missing. Downloads nothing.
set -uo pipefail

die() {
  echo "chart_test: FAIL: $*" >&2
  exit 1
}

HELM_DIR=deploy/helm
CHART="$HELM_DIR/optimus"
SHARD_BIN=server/optimus-shard
COORD_BIN=coordinator/optimus-coord
CTL_BIN=cli/optimusctl
MAKE_CA=scripts/make_local_ca.sh
[ -f "$CHART/Chart.yaml" ] || die "chart not found at $PWD/$CHART (run under bazel test)"
[ -x "$SHARD_BIN" ] && [ -x "$COORD_BIN" ] && [ -x "$CTL_BIN" ] ||
  die "optimus-shard / optimus-coord / optimusctl binaries missing from the runfiles"
[ -f "$MAKE_CA" ] || die "scripts/make_local_ca.sh missing from the runfiles"
command -v openssl >/dev/null || die "'openssl' not found (scripts/install_deps.sh); the TLS test hook run needs it."

# ---- prerequisites -----------------------------------------------------------------
GOCODE=/usr/share/gocode
command -v go >/dev/null || die "'go' not found. Install Debian's golang-go (scripts/install_deps.sh)."
[ -d "$GOCODE/src/github.com/Masterminds/sprig" ] ||
  die "sprig not found under $GOCODE. Install golang-github-masterminds-sprig-dev (scripts/install_deps.sh)."
[ -d "$GOCODE/src/gopkg.in/yaml.v3" ] ||
  die "gopkg.in/yaml.v3 not found under $GOCODE. Install golang-gopkg-yaml.v3-dev (scripts/install_deps.sh)."
command -v node >/dev/null || die "'node' not found. Install nodejs (scripts/install_deps.sh)."
# node_modules is not in the runfiles (git ignores it): find it beside the
# real package.json in the source tree.
TESTS_SRC="$(dirname "$(readlink -f "$HELM_DIR/tests/package.json")")"
NODE_MODULES="$TESTS_SRC/node_modules"
for m in kubernetes-models @kubernetes-models/prometheus-operator ajv yaml; do
  [ -d "$NODE_MODULES/$m" ] ||
    die "node module '$m' missing in $NODE_MODULES. Run: (cd $TESTS_SRC && npm ci), or scripts/install_deps.sh."
done
export NODE_PATH="$NODE_MODULES"
# Debian's python3 (not a pyenv or venv one) with python3-kubernetes.
PY=/usr/bin/python3
"$PY" -c "import kubernetes.client, yaml" 2>/dev/null ||
  die "the Kubernetes Python client is missing. Install python3-kubernetes (scripts/install_deps.sh)."

TMP="${TEST_TMPDIR:-$(mktemp -d)}/chart"
rm -rf "$TMP" && mkdir -p "$TMP/src/render"

# ---- build the renderer (offline: GOPATH mode over Debian's Go sources) -----------------
cp "$HELM_DIR/render/main.go" "$TMP/src/render/"
(cd "$TMP/src/render" &&
  GO111MODULE=off GOPATH="$GOCODE" GOCACHE="$TMP/gocache" GOFLAGS= GOPROXY=off \
    go build -o "$TMP/render" .) || die "building deploy/helm/render failed"
RENDER="$TMP/render"

VALIDATE=(node "$HELM_DIR/tests/validate.js" --schema="$CHART/values.schema.json"
  --shard-main=server/main.cc --binaries="$SHARD_BIN,$COORD_BIN")

# Runs every flag file in $1 through the binary that reads it.
check_flag_files() {
  local dir=$1 n=0 f bin out
  for f in "$dir"/*.flags; do
    [ -e "$f" ] || continue
    case "$(basename "$f")" in
      coordinator.flags) bin=$COORD_BIN ;;
      shard-*.flags) bin=$SHARD_BIN ;;
      *) die "unexpected flag file $(basename "$f") in the ConfigMap" ;;
    esac
    if ! out=$("$bin" --flagfile="$f" --version 2>&1); then
      echo "$out" >&2
      return 1
    fi
    n=$((n + 1))
  done
  echo "$n"
}

# ---- the value sets ------------------------------------------------------------------------------
summary=()
declare -A SET_VALUES=(
  [default]=""
  [dpu-only]="$CHART/ci/dpu-only-values.yaml"
  [host-only]="$CHART/ci/host-only-values.yaml"
  [full]="$CHART/ci/full-values.yaml"
  [plaintext]="$HELM_DIR/tests/values/plaintext-values.yaml"
  [etcd]="$CHART/ci/etcd-values.yaml"
  [etcd-external]="$HELM_DIR/tests/values/etcd-external-values.yaml"
)
for set in default dpu-only host-only full plaintext etcd etcd-external; do
  values_args=()
  [ -z "${SET_VALUES[$set]}" ] || values_args=(--values="${SET_VALUES[$set]}")
  out="$TMP/$set"
  mkdir -p "$out"
  "$RENDER" --chart="$CHART" --release=optimus --namespace=optimus --strict "${values_args[@]}" \
    --out="$out/manifests.yaml" --notes-out="$out/NOTES.txt" --values-out="$out/values.json" ||
    die "$set: rendering failed"
  line=$("${VALIDATE[@]}" --set="$set" --manifests="$out/manifests.yaml" --values="$out/values.json" \
    --flags-out="$out/flags" --hook-out="$out/hook.cmd") || die "$set: validation failed (above)"
  echo "$line"
  line=$("$PY" "$HELM_DIR/tests/strict_fields.py" "$out/manifests.yaml") || die "$set: unknown fields (above)"
  echo "$set: $line"
  nflags=$(check_flag_files "$out/flags") || die "$set: a rendered flag file is rejected by its binary (above)"
  [ "$nflags" -gt 0 ] || die "$set: no flag files rendered"
  echo "$set: $nflags flag files accepted by optimus-shard/optimus-coord --flagfile"
  grep -q "optimusctl --coordinator=" "$out/NOTES.txt" || die "$set: NOTES.txt does not say how to run optimusctl"
  grep -q "helm test optimus -n optimus" "$out/NOTES.txt" || die "$set: NOTES.txt does not mention helm test"
  summary+=("$set")
done
# The everything-on set runs DPU shards on the host network: NOTES.txt must say
# that the NetworkPolicy does not protect them, and name the alerts.
grep -q "dpu shards are NOT protected" "$TMP/full/NOTES.txt" ||
  die "full: NOTES.txt does not warn that NetworkPolicies skip hostNetwork shards"
grep -q "^Alerts: PrometheusRule optimus" "$TMP/full/NOTES.txt" || die "full: NOTES.txt does not mention the alerts"
[ -s "$TMP/plaintext/hook.cmd" ] && [ -s "$TMP/full/hook.cmd" ] || die "no helm test pod command rendered"
# The defaults tuned for where each shard kind runs: DPU steps behind the
# landings (alone on its cores), host steps at the trainers' priority; huge
# pages for both (docs/benchmarks.md).
for kind_flags in "shard-dpu:--step_nice=10" "shard-host:--step_nice=0" \
  "shard-dpu:--huge_pages=true" "shard-host:--huge_pages=true"; do
  f=$(ls "$TMP/default/flags/${kind_flags%%:*}"*.flags 2>/dev/null | head -1)
  [ -n "$f" ] || die "default: no ${kind_flags%%:*} flag file rendered"
  grep -qx -- "${kind_flags#*:}" "$f" || die "default: $(basename "$f") lacks ${kind_flags#*:}"
done

# ---- the `helm test` pod's command against a real coordinator -------------------------------------
# Runs the rendered command with the runfiles' optimusctl, the address of a
# local optimus-coord, and (TLS) a local certificate folder in place of the
# mounted Secret. Prints optimusctl's output; returns its exit status.
run_hook() {
  local cmdfile=$1 addr=$2 tls_dir=$3 a cmd=()
  while IFS= read -r a; do
    case "$a" in
      /usr/local/bin/optimusctl) a=$CTL_BIN ;;
      --coordinator=*) a="--coordinator=$addr" ;;
      --tls_dir=*) a="--tls_dir=$tls_dir" ;;
    esac
    cmd+=("$a")
  done <"$cmdfile"
  "${cmd[@]}" 2>&1
}
COORD_PID=
stop_coord() {
  [ -z "$COORD_PID" ] && return
  kill "$COORD_PID" 2>/dev/null
  wait "$COORD_PID" 2>/dev/null
  COORD_PID=
}
trap stop_coord EXIT
# Starts optimus-coord on a free port with the given TLS flag; sets COORD_ADDR.
start_coord() {
  local name=$1 tls_flag=$2 portfile="$TMP/$1.port" i
  mkdir -p "$TMP/$name.wd"
  (cd "$TMP/$name.wd" && exec "$OLDPWD/$COORD_BIN" --listen=127.0.0.1:0 --port_file="$portfile" "$tls_flag") \
    >"$TMP/$name.coord.log" 2>&1 &
  COORD_PID=$!
  for i in $(seq 1 600); do
    [ -s "$portfile" ] && break
    kill -0 "$COORD_PID" 2>/dev/null || die "$name: optimus-coord exited: $(cat "$TMP/$name.coord.log")"
    sleep 0.1
  done
  [ -s "$portfile" ] || die "$name: optimus-coord wrote no port file in 60 s: $(cat "$TMP/$name.coord.log")"
  COORD_ADDR="127.0.0.1:$(tr -d '[:space:]' <"$portfile")"
}

start_coord hook-plaintext --insecure_plaintext
out=$(run_hook "$TMP/plaintext/hook.cmd" "$COORD_ADDR" "") ||
  die "plaintext: the helm test command failed against a running coordinator: $out"
[[ "$out" == *STATE* ]] || die "plaintext: the helm test command printed no status: $out"
echo "helm-test-plaintext: $(head -n1 "$TMP/plaintext/hook.cmd" | xargs basename) $(sed -n '2,$p' "$TMP/plaintext/hook.cmd" | tr '\n' ' ')passes against a plain-text optimus-coord"
down_addr=$COORD_ADDR
stop_coord
if out=$(run_hook "$TMP/plaintext/hook.cmd" "$down_addr" ""); then
  die "plaintext: the helm test command passed with the coordinator down: $out"
fi
echo "helm-test-coordinator-down: fails as expected: $(echo "$out" | tail -n1)"

CA="$TMP/hook-ca"
bash "$MAKE_CA" "$CA" --shards 1 >/dev/null || die "make_local_ca.sh failed"
start_coord hook-tls --tls_dir="$CA/coordinator"
out=$(run_hook "$TMP/full/hook.cmd" "$COORD_ADDR" "$CA/admin") ||
  die "full: the helm test command failed against a TLS coordinator with an admin certificate: $out"
[[ "$out" == *STATE* ]] || die "full: the helm test command printed no status: $out"
echo "helm-test-tls: passes against a TLS optimus-coord with an admin certificate (tls.adminSecret)"
if out=$(run_hook "$TMP/full/hook.cmd" "$COORD_ADDR" "$CA/trainer"); then
  die "full: the helm test command passed with a trainer certificate, which may not read status: $out"
fi
echo "helm-test-tls-trainer: fails as expected with a trainer certificate: $(echo "$out" | grep -m1 -i refused)"
stop_coord

# ---- failures that must happen -----------------------------------------------------------------
expect_render_failure() {
  local name=$1 values=$2 want=$3 err
  if "$RENDER" --chart="$CHART" --strict --values="$values" --out="$TMP/$name.yaml" 2>"$TMP/$name.err"; then
    die "$name: rendering succeeded, expected it to fail with: $want"
  fi
  err=$(cat "$TMP/$name.err")
  [[ "$err" == *"$want"* ]] || die "$name: rendering failed, but the message does not say '$want': $err"
  echo "$name: fails as expected: $err"
}
expect_render_failure missing-coordinator-address "$HELM_DIR/tests/bad/missing-coordinator-address.yaml" \
  "coordinatorAddress is required when coordinator.enabled is false"
expect_render_failure memory-limit-too-small "$HELM_DIR/tests/bad/memory-limit-too-small.yaml" \
  "dpu.resources.limits.memory (13Gi = 13312 MiB) is below dpu.memoryLimitMb (16000)"
expect_render_failure networkpolicy-hostnetwork-without-cidrs "$HELM_DIR/tests/bad/networkpolicy-hostnetwork-without-cidrs.yaml" \
  "networkPolicy.enabled with dpu.hostNetwork=true needs networkPolicy.hostNetworkCIDRs"
expect_render_failure test-hook-tls-without-admin-secret "$HELM_DIR/tests/bad/test-hook-tls-without-admin-secret.yaml" \
  "tests.enabled with tls.enabled needs tls.adminSecret"
expect_render_failure alert-selector-with-braces "$HELM_DIR/tests/bad/alert-selector-with-braces.yaml" \
  "metrics.prometheusRule.selector must be PromQL label matchers without braces"
expect_render_failure ucx-port-range-reversed "$HELM_DIR/tests/bad/ucx-port-range-reversed.yaml" \
  "want 1024 <= FIRST <= LAST <= 65535"
expect_render_failure file-store-with-two-coordinators "$HELM_DIR/tests/bad/file-store-with-two-coordinators.yaml" \
  "coordinator.replicas is 2 but coordinator.stateStore is file"
expect_render_failure etcd-endpoints-not-host-port "$HELM_DIR/tests/bad/etcd-endpoints-not-host-port.yaml" \
  "etcd.endpoints must be HOST:PORT,HOST:PORT"

bad="$TMP/schema-violation"
mkdir -p "$bad"
"$RENDER" --chart="$CHART" --values="$HELM_DIR/tests/bad/schema-violation.yaml" \
  --out="$bad/manifests.yaml" --values-out="$bad/values.json" || die "schema-violation: rendering failed"
"${VALIDATE[@]}" --set=schema-violation --manifests="$bad/manifests.yaml" --values="$bad/values.json" \
  --expect-schema-failure || die "schema-violation: values.schema.json accepted bad values"
if "${VALIDATE[@]}" --set=schema-violation --manifests="$bad/manifests.yaml" --values="$bad/values.json" \
  >/dev/null 2>&1; then
  die "schema-violation: the validator passed values that values.schema.json rejects"
fi
# The new values: each mistake must be named.
bad="$TMP/schema-violation-new-values"
mkdir -p "$bad"
"$RENDER" --chart="$CHART" --values="$HELM_DIR/tests/bad/schema-violation-new-values.yaml" \
  --out="$bad/manifests.yaml" --values-out="$bad/values.json" || die "schema-violation-new-values: rendering failed"
out=$("${VALIDATE[@]}" --set=schema-violation-new-values --manifests="$bad/manifests.yaml" --values="$bad/values.json" \
  --expect-schema-failure) || die "schema-violation-new-values: values.schema.json accepted bad values"
for want in "values/networkPolicy/workers/0 must NOT have additional properties 'podSelectr'" \
  "values/networkPolicy/hostNetworkCIDRs/0 must match pattern" \
  "values/metrics/prometheusRule/alerts/shardDown/for must match pattern" \
  "values/metrics/prometheusRule/alerts/stepLatency/quantile must be < 1" \
  "values/metrics/prometheusRule/alertLabels property name must be valid" \
  "values/tests/enabled must be boolean"; do
  [[ "$out" == *"$want"* ]] || die "schema-violation-new-values: values.schema.json did not report '$want': $out"
done
echo "schema-violation-new-values: values.schema.json rejects a misspelt peer field, a CIDR without prefix, a bad duration, quantile, alert label and test switch"

# Broken manifests: the validator must catch each one, with the right message.
# BASE=set (default: default) names the rendering to break.
expect_validate_failure() {
  local name=$1 sed_expr=$2 want=$3 err base=${BASE:-default}
  sed "$sed_expr" "$TMP/$base/manifests.yaml" >"$TMP/$name.yaml"
  cmp -s "$TMP/$name.yaml" "$TMP/$base/manifests.yaml" && die "$name: the mutation changed nothing"
  if "${VALIDATE[@]}" --set="$name" --manifests="$TMP/$name.yaml" --values="$TMP/$base/values.json" \
    >/dev/null 2>"$TMP/$name.err"; then
    die "$name: the validator accepted a broken manifest"
  fi
  err=$(cat "$TMP/$name.err")
  [[ "$err" == *"$want"* ]] || die "$name: the validator failed, but without '$want': $err"
  echo "$name: caught: $(grep -m1 -F -- "$want" "$TMP/$name.err" | sed 's/^ *- //')"
}
expect_validate_failure mutated-probe-path '0,/path: \/healthz/s//path: \/health/' "not /healthz"
expect_validate_failure mutated-duplicate-key 's/^  replicas: 1$/  replicas: 1\n  replicas: 2/' "Map keys must be unique"
expect_validate_failure mutated-port-type '0,/containerPort: 9091/s//containerPort: "9091x"/' "containerPort must be integer"
expect_validate_failure mutated-node-selector 's/optimus.dev\/dpu: "true"/optimus.dev\/dpu: "yes"/' "differs from values dpu.nodeSelector"
expect_validate_failure mutated-hook-without-certificate '/--tls_dir=\/etc\/optimus-admin-tls/d' \
  "is not the admin Secret optimus-admin-tls"
BASE=full expect_validate_failure mutated-alert-expr-type \
  's/^\( *\)expr: \(optimus_coord_shard_up.*\)$/\1expr:\n\1  query: '"'"'\2'"'"'/' "expr must be"
BASE=full expect_validate_failure mutated-alert-misspelt-for '0,/^\( *\)for: /s//\1fro: /' "unknown field 'fro'"
BASE=full expect_validate_failure mutated-alert-metric 's/optimus_coord_shard_up{/optimus_coord_shards_up{/' \
  "metric optimus_coord_shards_up is not exported by optimus-coord or optimus-shard"
BASE=full expect_validate_failure mutated-alert-threshold 's/^\( *\)> 0\.3$/\1> 3/' \
  "expr does not use quantile 0.99, window 5m and threshold 0.3 from values"
BASE=full expect_validate_failure mutated-policy-without-shards \
  '/^kind: NetworkPolicy$/,/^---$/s/optimus.dev\/role: shard$/optimus.dev\/role: shards/' \
  "shards cannot reach the coordinator's gRPC port"
BASE=full expect_validate_failure mutated-policy-open-rule '0,/^      from:$/s//      x-from:/' \
  "has no 'from', so it admits every source"
# etcd mode: a standby must never be routed to, and etcd must stay the
# coordinators' alone.
BASE=etcd expect_validate_failure mutated-etcd-service-routes-standbys \
  '/^kind: Service$/,/^---$/s/^  type: ClusterIP$/  type: ClusterIP\n  publishNotReadyAddresses: true/' \
  "no coordinator Service that routes to ready pods only"
BASE=etcd expect_validate_failure mutated-etcd-one-replica '/^kind: Deployment$/,/^---$/s/^  replicas: 2$/  replicas: 1/' \
  "the coordinator Deployment runs 1 pods, want 2"
BASE=etcd expect_validate_failure mutated-etcd-missing-member \
  's/^\( *--etcd_endpoints=.*\),[^,]*etcd-2[^,]*$/\1/' "want every member"
BASE=etcd expect_validate_failure mutated-etcd-open-to-shards \
  '/^kind: NetworkPolicy$/,/^---$/s/app.kubernetes.io\/component: coordinator$/app.kubernetes.io\/component: etcd/' \
  "the coordinators cannot reach etcd's client port"

sed '0,/livenessProbe:/s//livenessprobe:/' "$TMP/default/manifests.yaml" >"$TMP/misspelt-field.yaml"
if "$PY" "$HELM_DIR/tests/strict_fields.py" "$TMP/misspelt-field.yaml" 2>"$TMP/misspelt-field.err" >/dev/null; then
  die "misspelt-field: strict_fields.py accepted 'livenessprobe'"
fi
grep -q "livenessprobe: not a field of V1Container" "$TMP/misspelt-field.err" ||
  die "misspelt-field: wrong message: $(cat "$TMP/misspelt-field.err")"
echo "misspelt-field: caught: $(grep -m1 livenessprobe "$TMP/misspelt-field.err" | sed 's/^ *- //')"

sed '/^kind: NetworkPolicy$/,/^---$/s/^  policyTypes:/  policytypes:/' "$TMP/full/manifests.yaml" >"$TMP/misspelt-policy-field.yaml"
if "$PY" "$HELM_DIR/tests/strict_fields.py" "$TMP/misspelt-policy-field.yaml" 2>"$TMP/misspelt-policy-field.err" >/dev/null; then
  die "misspelt-policy-field: strict_fields.py accepted 'policytypes' in a NetworkPolicy"
fi
grep -q "policytypes: not a field of V1NetworkPolicySpec" "$TMP/misspelt-policy-field.err" ||
  die "misspelt-policy-field: wrong message: $(cat "$TMP/misspelt-policy-field.err")"
echo "misspelt-policy-field: caught: $(grep -m1 policytypes "$TMP/misspelt-policy-field.err" | sed 's/^ *- //')"

printf -- '--coordinator=optimus-coord.optimus.svc:7070\n--no_such_flag=1\n' >"$TMP/unknown-flag.flags"
if "$SHARD_BIN" --flagfile="$TMP/unknown-flag.flags" --version >/dev/null 2>&1; then
  die "optimus-shard accepted an unknown flag in a flag file; the flag-file check proves nothing"
fi
echo "unknown-flag: optimus-shard rejects a flag file with an unknown flag"

echo "chart_test: PASS (${summary[*]} rendered and validated; helm test command run against real coordinators; 8 render failures, 2 schema failures, 17 broken manifests and 1 bad flag file caught)"
