#!/usr/bin/env bash
# Cross-compiles the CPU kernels for aarch64 (BlueField's Arm cores) with
# Debian's g++-aarch64-linux-gnu and runs optimizer_neon_test.cc under
# qemu-aarch64 (user mode): NEON against the scalar reference, bit for bit.
# Both tools come from scripts/install_deps.sh; without them this fails.
#
# Debian has no arm64 abseil/gtest without multiarch, so: the hot-path files
# (scalar, NEON, thread pool, dtype conversions) use only header-only abseil
# and are linked with --gc-sections, which drops dtype.cc's Status-returning
# parsers; optimizer.cc (validation, dispatch) is compiled for aarch64 too,
# to prove the whole library builds, but not linked.
set -euo pipefail

CXX=aarch64-linux-gnu-g++
QEMU=""
for q in qemu-aarch64 qemu-aarch64-static; do
  if command -v "$q" >/dev/null; then QEMU="$q"; break; fi
done
if ! command -v "$CXX" >/dev/null || [ -z "$QEMU" ]; then
  echo "aarch64_qemu_test: needs $CXX (g++-aarch64-linux-gnu) and qemu-aarch64" \
       "(qemu-user); run scripts/install_deps.sh" >&2
  exit 1
fi
SYSROOT=/usr/aarch64-linux-gnu  # libc6-arm64-cross, for the dynamic loader

# Sources: the runfiles tree under bazel test, else this checkout.
if [ -n "${TEST_SRCDIR:-}" ]; then
  ROOT="$TEST_SRCDIR/${TEST_WORKSPACE:-optimus}"
else
  ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
fi
WORK="$(mktemp -d "${TEST_TMPDIR:-/tmp}/aarch64.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# Abseil's headers are architecture-independent; expose only them, not the
# host's /usr/include.
mkdir -p "$WORK/include"
ln -s /usr/include/absl "$WORK/include/absl"

FLAGS=(-std=c++17 -O2 -ffp-contract=off -Wall -Wextra -pthread
       -I"$ROOT" -isystem "$WORK/include" -ffunction-sections -fdata-sections)
K="$ROOT/kernels/cpu"

echo "aarch64_qemu_test: $("$CXX" --version | head -1); $("$QEMU" --version | head -1)"
"$CXX" "${FLAGS[@]}" -c "$K/optimizer.cc" -o "$WORK/optimizer.o"
"$CXX" "${FLAGS[@]}" \
  "$K/optimizer_neon_test.cc" "$K/optimizer_neon.cc" "$K/optimizer_scalar.cc" \
  "$K/thread_pool.cc" "$ROOT/common/dtype.cc" \
  -Wl,--gc-sections -o "$WORK/optimizer_neon_test"

# No fused multiply-add may appear: it would break bit-equality with x86.
if aarch64-linux-gnu-objdump -d "$WORK/optimizer_neon_test" "$WORK/optimizer.o" 2>/dev/null |
    grep -qE '\s(fmla|fmls|fmadd|fmsub|fnmadd|fnmsub)\s'; then
  echo "aarch64_qemu_test: FAIL: fused multiply-add in the aarch64 kernels" >&2
  exit 1
fi

QEMU_LD_PREFIX="$SYSROOT" "$QEMU" -L "$SYSROOT" "$WORK/optimizer_neon_test"
