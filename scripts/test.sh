#!/usr/bin/env bash
# Runs the whole test suite (bazel test //...) and ends with one line:
# "N passed, N failed, N skipped", counting test cases.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh || exit 1

log=$(mktemp)
bazel test //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
python3 scripts/count_tests.py "$log" "$(bazel info bazel-testlogs 2>/dev/null)"
count_rc=$?
rm -f "$log"
# 0: all passed; 3: some test failed; 1: the build failed; 4: no tests.
if [ "$rc" -ne 0 ] || [ "$count_rc" -ne 0 ]; then exit 1; fi
exit 0
