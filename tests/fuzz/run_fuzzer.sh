#!/usr/bin/env bash
# Runs one fuzz target (see fuzz.bzl). Usage: run_fuzzer.sh BINARY SEED_DIR MODE
#   MODE replay: every file of SEED_DIR once (the default gcc build).
#   MODE fuzz:   libFuzzer for OPTIMUS_FUZZ_SECONDS (default 60) from SEED_DIR
#                (--config=fuzz). A crash, a sanitizer report, a leak, an
#                input slower than 25 s or above 2.5 GB RSS fails the test;
#                the input that did it is kept and its path printed.
set -uo pipefail
bin="$1"; seeds="$2"; mode="$3"
name="$(basename "${bin}")"
if [ -z "$(ls -A "${seeds}" 2>/dev/null)" ]; then
  echo "${name}: no seed corpus in ${seeds} (bazel run //tests/fuzz:make_seeds -- \"\$PWD/tests/fuzz/corpus\")" >&2
  exit 1
fi

if [ "${mode}" = "replay" ]; then
  exec "${bin}" "${seeds}"
fi

secs="${OPTIMUS_FUZZ_SECONDS:-60}"
out="${TEST_UNDECLARED_OUTPUTS_DIR:-$(mktemp -d)}"
work="${TEST_TMPDIR:-$(mktemp -d)}/corpus"
mkdir -p "${out}" "${work}"
echo "${name}: fuzzing for ${secs} s from $(ls "${seeds}" | wc -l) seeds in ${seeds}"
# New inputs go to ${work} (the first folder); the seeds are read only.
"${bin}" -max_total_time="${secs}" -timeout=25 -rss_limit_mb=2560 -print_final_stats=1 \
  -artifact_prefix="${out}/" "${work}" "${seeds}" 2>&1 | tail -n 400
rc=${PIPESTATUS[0]}
if [ "${rc}" -eq 0 ]; then
  echo "${name}: no crash in ${secs} s; $(ls "${work}" | wc -l) new inputs found (not kept)"
  exit 0
fi
echo "${name}: FAILED (libFuzzer exit ${rc})"
found=0
for f in "${out}"/crash-* "${out}"/leak-* "${out}"/timeout-* "${out}"/oom-* "${out}"/slow-unit-*; do
  [ -e "${f}" ] || continue
  found=1
  base="$(basename "${f}")"
  echo "${name}: reproducer: ${base}, $(stat -c %s "${f}") bytes"
  # Under bazel: the test's outputs folder, which stays (and is zipped to
  # outputs.zip beside it) under $(bazel info --config=fuzz bazel-testlogs)
  # /tests/fuzz/<target>_test/test.outputs/.
  echo "${name}:   kept at ${f}"
  echo "${name}:   first bytes in hex:"
  od -A d -t x1 -v "${f}" | head -n 16
  if [ "$(stat -c %s "${f}")" -le 65536 ]; then
    echo "${name}:   the whole input, to recreate it from this log: base64 -d > ${base} <<'END'"
    base64 "${f}"
    echo "END"
  fi
  echo "${name}:   reproduce: bazel run --config=fuzz //tests/fuzz:${name} -- \$PWD/${base}"
  echo "${name}:   once fixed, keep it: cp ${base} tests/fuzz/corpus/${name%_fuzzer}/<what_it_was>"
done
[ "${found}" -eq 1 ] || echo "${name}: libFuzzer kept no reproducer (see its output above)"
exit 1
