#!/usr/bin/env bash
# The aarch64 optimus-shard: cross-builds it and the unit tests of its
# components with deploy/aarch64/build.sh (-O1, to save time), checks that the
# binary is an aarch64 ELF that starts under qemu-aarch64, then runs every
# test binary under qemu-aarch64 and prints its GoogleTest output.
# Needs g++-aarch64-linux-gnu, qemu-user and the arm64 sysroot; all come from
# scripts/install_deps.sh. Without them this fails and says what is missing.
set -uo pipefail

fail() { echo "aarch64_qemu_test: FAIL: $*" >&2; exit 1; }

if [ -n "${TEST_SRCDIR:-}" ]; then
  ROOT="$TEST_SRCDIR/${TEST_WORKSPACE:-optimus}"
else
  ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
fi
HERE="$ROOT/deploy/aarch64"
# The source list from //deploy/aarch64:sources (the BUILD files' graph).
MANIFEST="${1:-}"
[ -n "$MANIFEST" ] || fail "usage: $0 SOURCES_TXT (bazel test //deploy/aarch64:aarch64_qemu_test passes it)"
case "$MANIFEST" in /*) ;; *) MANIFEST="$PWD/$MANIFEST" ;; esac
SYSROOT="${OPTIMUS_AARCH64_SYSROOT:-/opt/optimus-aarch64-sysroot}"

missing=()
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=("aarch64-linux-gnu-g++ (g++-aarch64-linux-gnu)")
command -v qemu-aarch64 >/dev/null || command -v qemu-aarch64-static >/dev/null ||
  missing+=("qemu-aarch64 (qemu-user)")
[ -f "$SYSROOT/.optimus-sysroot-packages" ] ||
  missing+=("the arm64 libraries in $SYSROOT (deploy/aarch64/fetch_sysroot.sh)")
if [ "${#missing[@]}" -gt 0 ]; then
  printf 'aarch64_qemu_test: missing: %s\n' "${missing[@]}" >&2
  fail "run scripts/install_deps.sh (it installs the cross toolchain and qemu, and fetches the arm64 sysroot)"
fi

WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/aarch64.XXXXXX")"
mkdir -p "$WORK/xml"
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

"$HERE/build.sh" --tests --opt=-O1 --sources="$MANIFEST" "$WORK/out" || fail "the aarch64 cross build failed (output above)"
echo "aarch64_qemu_test: cross build took $((SECONDS - start))s"

SHARD="$WORK/out/optimus-shard"
# file(1) when installed; the ELF header (binutils, always there with g++) too.
if command -v file >/dev/null; then
  desc="$(file -b "$SHARD")"
  echo "aarch64_qemu_test: file optimus-shard: $desc"
  case "$desc" in
    *"ELF 64-bit"*"ARM aarch64"*) ;;
    *) fail "optimus-shard is not an aarch64 ELF: $desc" ;;
  esac
fi
machine="$(LC_ALL=C readelf -h "$SHARD" 2>&1 | grep -E 'Class|Machine' | tr -s ' ' | tr '\n' ' ')"
echo "aarch64_qemu_test: readelf -h optimus-shard: $machine"
grep -q "ELF64" <<< "$machine" && grep -q "AArch64" <<< "$machine" ||
  fail "optimus-shard is not a 64-bit AArch64 ELF: $machine"

RUN="$HERE/qemu_run.sh"
# It starts: flags parse and --helpfull lists the shard's own flags...
help="$("$RUN" "$SHARD" --helpfull 2>&1)"
for flag in --coordinator --kind --memory_limit_mb --transports; do
  grep -q -- "$flag " <<< "$help" || { echo "$help" | head -40; fail "optimus-shard --helpfull under qemu does not list $flag"; }
done
echo "aarch64_qemu_test: optimus-shard --helpfull under qemu lists its flags:"
grep -A1 -- '--coordinator \|--kind ' <<< "$help" | sed 's/^/  /'
# --version exits 0 (the arm64 image's Dockerfile runs it)...
ver="$("$RUN" "$SHARD" --version 2>&1)" || fail "optimus-shard --version under qemu failed: $ver"
grep -q "^optimus-shard [0-9]" <<< "$ver" || fail "optimus-shard --version under qemu printed no version: $ver"
echo "aarch64_qemu_test: optimus-shard --version under qemu: $(echo $ver)"
# ...and main() runs its own checks.
out="$("$RUN" "$SHARD" --kind=arm 2>&1)"; rc=$?
[ "$rc" = 2 ] && grep -q -- "--kind must be dpu or host" <<< "$out" ||
  fail "optimus-shard --kind=arm under qemu: expected exit 2 and a --kind error, got rc=$rc: $out"
echo "aarch64_qemu_test: optimus-shard --kind=arm under qemu: rc=2, '$out'"

# The unit tests, as many as build.sh made from the source list.
failed=()
tests=()
for bin in "$WORK"/out/tests/*; do [ -x "$bin" ] && tests+=("$(basename "$bin")"); done
[ "${#tests[@]}" -gt 0 ] || fail "build.sh made no test binaries"
for t in "${tests[@]}"; do
  bin="$WORK/out/tests/$t"
  echo
  echo "=== aarch64 $t (qemu-aarch64)"
  t0=$SECONDS
  "$RUN" "$bin" --gtest_output="xml:$WORK/xml/$t.xml" 2>&1
  rc=$?
  echo "=== aarch64 $t: rc=$rc, $((SECONDS - t0))s"
  [ "$rc" = 0 ] || failed+=("$t")
  [ -s "$WORK/xml/$t.xml" ] || { [ "$rc" != 0 ] || failed+=("$t (no XML result)"); }
done

# One XML for Bazel (scripts/count_tests.py counts its test cases), suite
# names prefixed with aarch64/.
if [ -n "${XML_OUTPUT_FILE:-}" ]; then
  python3 - "$XML_OUTPUT_FILE" "$WORK"/xml/*.xml <<'PY' || echo "aarch64_qemu_test: could not merge the XML results" >&2
import sys, xml.etree.ElementTree as ET
root = ET.Element("testsuites", name="aarch64_qemu_test")
for path in sys.argv[2:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        suite.set("name", "aarch64/" + suite.get("name", ""))
        root.append(suite)
ET.ElementTree(root).write(sys.argv[1], encoding="utf-8", xml_declaration=True)
PY
fi

echo
if [ "${#failed[@]}" -gt 0 ]; then
  fail "under qemu-aarch64: ${failed[*]} (output above); $((SECONDS - start))s"
fi
echo "aarch64_qemu_test: PASS: optimus-shard builds for aarch64 and starts under qemu;" \
     "${#tests[@]} unit-test binaries (${tests[*]}) pass under qemu-aarch64 ($((SECONDS - start))s)"
