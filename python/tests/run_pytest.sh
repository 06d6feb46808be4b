#!/usr/bin/env bash
# Runs the Python package's pytest suite (python/tests) under Bazel with
# Debian's python3 (python3-torch, python3-pytest): the package and its
# extension from the runfiles, optimus-coord/optimus-shard from the data deps.
# One JUnit <testcase> per test in $XML_OUTPUT_FILE (scripts/count_tests.py).
set -euo pipefail
root="${TEST_SRCDIR}/optimus"
export OPTIMUS_PYTHONPATH="${root}/python"
export PYTHONPATH="${root}/python${PYTHONPATH:+:${PYTHONPATH}}"
export OPTIMUS_BIN_DIR="${root}"
export PYTHONDONTWRITEBYTECODE=1
cd "${TEST_TMPDIR}"
exec /usr/bin/python3 -m pytest -p no:cacheprovider -v -rs \
  --rootdir="${root}/python/tests" --junitxml="${XML_OUTPUT_FILE:-${TEST_TMPDIR}/pytest.xml}" \
  "${root}/python/tests" "$@"
