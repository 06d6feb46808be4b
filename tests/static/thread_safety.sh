#!/usr/bin/env bash
# Compiles every annotated source with clang's thread-safety analysis
# (-Wthread-safety, as errors): a guarded field read or written without its
# lock, or a function called without the lock it requires, fails the build.
# Usage: thread_safety.sh OUT_LOG GEN_DIR SOURCES...   (run by the genrule in
# BUILD; GEN_DIR holds the generated proto/ headers, and etcd's under
# external/etcd_api).
set -euo pipefail
out="$1"; gen="$2"; shift 2
CLANG="$(command -v clang++-14 || command -v clang++ || true)"
if [ -z "${CLANG}" ]; then
  echo "thread_safety: clang++ not found (Debian's clang; scripts/install_deps.sh installs it)" >&2
  exit 1
fi
# Only the analysis' warnings, as errors; everything else is gcc's job.
FLAGS=(-std=c++17 -fsyntax-only -Wno-everything -Wthread-safety -Werror=thread-safety
       -I. -I"${gen}" -I"${gen}/external/etcd_api" -I/usr/include/torch/csrc/api/include
       $(pkg-config --cflags grpc++ protobuf ucx))
checked=0
failed=0
: > "${out}"
for src in "$@"; do
  case "${src}" in *.cc) ;; *) continue ;; esac
  if ! "${CLANG}" "${FLAGS[@]}" "${src}" 2>>"${out}.err"; then
    failed=$((failed + 1))
    echo "FAILED ${src}" >> "${out}"
  else
    echo "ok ${src}" >> "${out}"
  fi
  checked=$((checked + 1))
done
echo "checked ${checked} files with ${CLANG} -Wthread-safety, ${failed} failed" >> "${out}"
if [ "${failed}" -gt 0 ]; then
  cat "${out}.err" >&2
  exit 1
fi
rm -f "${out}.err"
