#!/usr/bin/env bash
# Runs the whole test suite and ends with one line: "N passed, N failed,
# N skipped", counting test cases. Two bazel runs:
#   1. bazel test //...  (gcc; the fuzz targets replay their corpora)
#   2. bazel test --config=fuzz //tests/fuzz:ci  (clang, ASan+UBSan): each
#      fuzz target fuzzes for $OPTIMUS_FUZZ_SECONDS (60 s), and the unit and
#      integration tests run under the sanitizers (docs/testing.md).
# OPTIMUS_SKIP_SANITIZERS=1 skips the second run.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh || exit 1

log=$(mktemp)
bazel test //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
counts=("$log" "$(bazel info bazel-testlogs 2>/dev/null)")

san_rc=0
san_log=$(mktemp)
if [ "${OPTIMUS_SKIP_SANITIZERS:-0}" != "1" ]; then
  echo "=== sanitizers and fuzzing: bazel test --config=fuzz //tests/fuzz:ci (docs/testing.md)"
  start=$(date +%s)
  bazel test --config=fuzz //tests/fuzz:ci "$@" 2>&1 | tee "$san_log"
  san_rc=${PIPESTATUS[0]}
  echo "=== sanitizers and fuzzing took $(( $(date +%s) - start )) s"
  counts+=("$san_log" "$(bazel info --config=fuzz bazel-testlogs 2>/dev/null)")
fi

python3 scripts/count_tests.py "${counts[@]}"
count_rc=$?
rm -f "$log" "$san_log"
# 0: all passed; 3: some test failed; 1: the build failed; 4: no tests.
if [ "$rc" -ne 0 ] || [ "$san_rc" -ne 0 ] || [ "$count_rc" -ne 0 ]; then exit 1; fi
exit 0
