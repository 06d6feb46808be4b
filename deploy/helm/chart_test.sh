#!/usr/bin/env bash
# Tests the optimus Helm chart with no cluster and no helm binary:
#   1. builds deploy/helm/render (Go text/template + sprig, Helm's functions);
#   2. renders the chart with three value sets: default, DPU-only
#      (optimus/ci/dpu-only-values.yaml) and host-only (optimus/ci/host-only-values.yaml);
#   3. validates each rendering with tests/validate.js: YAML without duplicate
#      keys, every object against the Kubernetes API schemas, the merged values
#      against values.schema.json, and what a user would notice (DaemonSets only
#      for the enabled kinds, probes on /healthz at the metrics port,
#      nodeSelector/tolerations from values, selectors that select);
#      strict_fields.py then rejects fields the Kubernetes API does not define;
#   4. runs every rendered flag file through the real binary
#      (optimus-shard / optimus-coord --flagfile=F --version), which rejects
#      unknown flags and bad values;
#   5. checks that it fails when it should: a missing required value, a memory
#      limit below the state budget, values the schema rejects, and broken
#      manifests (wrong probe path, duplicate key, bad field type, misspelt field,
#      unknown flag).
# Needs golang-go, golang-github-masterminds-sprig-dev, golang-gopkg-yaml.v3-dev,
# nodejs, python3-kubernetes and deploy/helm/tests/node_modules (scripts/install_deps.sh installs
# them all); fails saying what is missing. Downloads nothing.
set -uo pipefail

die() {
  echo "chart_test: FAIL: $*" >&2
  exit 1
}

HELM_DIR=deploy/helm
CHART="$HELM_DIR/optimus"
SHARD_BIN=server/optimus-shard
COORD_BIN=coordinator/optimus-coord
[ -f "$CHART/Chart.yaml" ] || die "chart not found at $PWD/$CHART (run under bazel test)"
[ -x "$SHARD_BIN" ] && [ -x "$COORD_BIN" ] || die "optimus-shard / optimus-coord binaries missing from the runfiles"

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
  --shard-main=server/main.cc)

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

# ---- the three value sets -------------------------------------------------------------------
summary=()
for set in default dpu-only host-only; do
  values_args=()
  [ "$set" = default ] || values_args=(--values="$CHART/ci/$set-values.yaml")
  out="$TMP/$set"
  mkdir -p "$out"
  "$RENDER" --chart="$CHART" --release=optimus --namespace=optimus --strict "${values_args[@]}" \
    --out="$out/manifests.yaml" --notes-out="$out/NOTES.txt" --values-out="$out/values.json" ||
    die "$set: rendering failed"
  line=$("${VALIDATE[@]}" --set="$set" --manifests="$out/manifests.yaml" --values="$out/values.json" \
    --flags-out="$out/flags") || die "$set: validation failed (above)"
  echo "$line"
  line=$("$PY" "$HELM_DIR/tests/strict_fields.py" "$out/manifests.yaml") || die "$set: unknown fields (above)"
  echo "$set: $line"
  nflags=$(check_flag_files "$out/flags") || die "$set: a rendered flag file is rejected by its binary (above)"
  [ "$nflags" -gt 0 ] || die "$set: no flag files rendered"
  echo "$set: $nflags flag files accepted by optimus-shard/optimus-coord --flagfile"
  grep -q "optimusctl --coordinator=" "$out/NOTES.txt" || die "$set: NOTES.txt does not say how to run optimusctl"
  summary+=("$set")
done

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

# Broken manifests: the validator must catch each one, with the right message.
expect_validate_failure() {
  local name=$1 sed_expr=$2 want=$3 err
  sed "$sed_expr" "$TMP/default/manifests.yaml" >"$TMP/$name.yaml"
  cmp -s "$TMP/$name.yaml" "$TMP/default/manifests.yaml" && die "$name: the mutation changed nothing"
  if "${VALIDATE[@]}" --set="$name" --manifests="$TMP/$name.yaml" --values="$TMP/default/values.json" \
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

sed '0,/livenessProbe:/s//livenessprobe:/' "$TMP/default/manifests.yaml" >"$TMP/misspelt-field.yaml"
if "$PY" "$HELM_DIR/tests/strict_fields.py" "$TMP/misspelt-field.yaml" 2>"$TMP/misspelt-field.err" >/dev/null; then
  die "misspelt-field: strict_fields.py accepted 'livenessprobe'"
fi
grep -q "livenessprobe: not a field of V1Container" "$TMP/misspelt-field.err" ||
  die "misspelt-field: wrong message: $(cat "$TMP/misspelt-field.err")"
echo "misspelt-field: caught: $(grep -m1 livenessprobe "$TMP/misspelt-field.err" | sed 's/^ *- //')"

printf -- '--coordinator=optimus-coord.optimus.svc:7070\n--no_such_flag=1\n' >"$TMP/unknown-flag.flags"
if "$SHARD_BIN" --flagfile="$TMP/unknown-flag.flags" --version >/dev/null 2>&1; then
  die "optimus-shard accepted an unknown flag in a flag file; the flag-file check proves nothing"
fi
echo "unknown-flag: optimus-shard rejects a flag file with an unknown flag"

echo "chart_test: PASS (${summary[*]} rendered and validated; 2 render failures, 1 schema failure, 5 broken manifests and 1 bad flag file caught)"
