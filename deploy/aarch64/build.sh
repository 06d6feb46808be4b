#!/usr/bin/env bash
# Cross-builds optimus-shard for aarch64 (BlueField's Arm cores) on an x86-64
# Debian 12 host, outside Bazel (Bazel here only builds for the host):
#
#   deploy/aarch64/build.sh [--tests] [--opt=-O2] [--jobs=N] [--sources=F] [OUT]
#
#   OUT        output folder (default: out/aarch64 in this checkout)
#   --tests    also build the unit tests of the shard's components
#              (OUT/tests/*; run one with deploy/aarch64/qemu_run.sh)
#   --opt      optimization flags (default "-O2 -DNDEBUG", as bazel -c opt;
#              the qemu test uses -O1, asserts on)
#   --jobs     parallel compiles (default: the core count)
#   --sources  the source list; default: bazel build //deploy/aarch64:sources
#
# protoc and grpc_cpp_plugin run on the host to generate the C++ sources of
# proto/optimus.proto; everything is compiled with aarch64-linux-gnu-g++
# (libstdc++ and glibc from the cross toolchain) against the arm64 grpc++,
# protobuf, UCX, abseil, cpp-httplib, nlohmann-json and gtest in the sysroot that fetch_sysroot.sh fills
# (/opt/optimus-aarch64-sysroot, or $OPTIMUS_AARCH64_SYSROOT). The binary
# links them dynamically and carries no rpath: on the DPU (or in the arm64
# container image) Debian's own arm64 packages provide them.
#
# Which sources (and copts) make up each binary comes from the BUILD files:
# //deploy/aarch64:sources walks //server:optimus-shard's and the tests' deps
# (deploy/aarch64/sources.bzl), so a source added there is built here too.
set -euo pipefail

usage() { sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }
fail() { echo "aarch64 build: $*" >&2; exit 1; }

WITH_TESTS=0
MANIFEST=""
OPT="-O2 -DNDEBUG"
JOBS="$(nproc 2>/dev/null || echo 2)"
OUT=""
for a in "$@"; do
  case "$a" in
    --tests) WITH_TESTS=1 ;;
    --opt=*) OPT="${a#--opt=}" ;;
    --jobs=*) JOBS="${a#--jobs=}" ;;
    --sources=*) MANIFEST="${a#--sources=}" ;;
    -h|--help) usage 0 ;;
    -*) echo "aarch64 build: unknown option $a" >&2; usage ;;
    *) OUT="$a" ;;
  esac
done

# Sources: the runfiles tree under bazel test, else this checkout.
if [ -n "${TEST_SRCDIR:-}" ]; then
  ROOT="$TEST_SRCDIR/${TEST_WORKSPACE:-optimus}"
else
  ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
fi
OUT="${OUT:-$ROOT/out/aarch64}"
SYSROOT="${OPTIMUS_AARCH64_SYSROOT:-/opt/optimus-aarch64-sysroot}"
CXX=aarch64-linux-gnu-g++

# --- tools and libraries, with what to run when they are missing ----------
command -v "$CXX" >/dev/null ||
  fail "$CXX not found: apt-get install g++-aarch64-linux-gnu (scripts/install_deps.sh)"
for t in protoc grpc_cpp_plugin pkg-config; do
  command -v "$t" >/dev/null ||
    fail "$t not found on the host (protobuf-compiler, protobuf-compiler-grpc, pkg-config; scripts/install_deps.sh)"
done
[ -f "$SYSROOT/.optimus-sysroot-packages" ] ||
  fail "no arm64 sysroot at $SYSROOT: run deploy/aarch64/fetch_sysroot.sh (scripts/install_deps.sh does)"
export PKG_CONFIG_SYSROOT_DIR="$SYSROOT"
export PKG_CONFIG_LIBDIR="$SYSROOT/usr/lib/aarch64-linux-gnu/pkgconfig:$SYSROOT/usr/share/pkgconfig"
export PKG_CONFIG_PATH=""
# The same pkg-config modules as the host build's WORKSPACE.
PC_LIB=(grpc++ protobuf ucx absl_status absl_statusor absl_strings absl_str_format
        absl_synchronization absl_time absl_flags absl_flags_parse absl_hash
        absl_raw_hash_set libcrypto cpp-httplib nlohmann_json)
PC_TEST=(gtest gmock)
pkg-config --exists "${PC_LIB[@]}" "${PC_TEST[@]}" 2>/dev/null ||
  fail "the sysroot $SYSROOT lacks arm64 libraries ($(pkg-config --print-errors --exists "${PC_LIB[@]}" "${PC_TEST[@]}" 2>&1 | head -1)); rerun deploy/aarch64/fetch_sysroot.sh"
# Generated code must come from the protoc of the library it is compiled
# against.
host_protoc="$(protoc --version | awk '{print $2}')"
arm_protobuf="$(pkg-config --modversion protobuf)"
[ "$host_protoc" = "$arm_protobuf" ] ||
  fail "host protoc is $host_protoc but the arm64 libprotobuf is $arm_protobuf; update one to match"

# --- sources: from the BUILD files ----------------------------------------
# sources.txt lists, per target, its .cc files and theirs deps' with copts
# (deploy/aarch64/sources.bzl); under bazel test it comes as an argument.
if [ -z "$MANIFEST" ]; then
  command -v bazel >/dev/null || fail "bazel not found; pass --sources=sources.txt"
  (cd "$ROOT" && bazel build //deploy/aarch64:sources >&2) || fail "bazel build //deploy/aarch64:sources failed"
  MANIFEST="$(cd "$ROOT" && bazel info bazel-bin 2>/dev/null)/deploy/aarch64/sources.txt"
fi
[ -s "$MANIFEST" ] || fail "source list $MANIFEST missing or empty"
declare -A TARGET_SRCS=() COPTS=()
TARGETS=()
while IFS=$'\t' read -r target kind path copts; do
  [ -n "$target" ] || continue
  if [ "$target" != optimus-shard ] && [ "$WITH_TESTS" != 1 ]; then continue; fi
  [ -n "${TARGET_SRCS[$target]+x}" ] || TARGETS+=("$target")
  case "$kind" in
    gen) path="gen/$path" ;;   # protoc's outputs, made below
    src) ;;
    *) fail "bad line in $MANIFEST: $target $kind $path" ;;
  esac
  TARGET_SRCS[$target]+="$path "
  COPTS[$path]="$copts"
done < "$MANIFEST"
[ -n "${TARGET_SRCS[optimus-shard]+x}" ] || fail "$MANIFEST has no optimus-shard"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -rf "$OUT/gen" "$OUT/obj"
mkdir -p "$OUT/gen/proto" "$OUT/obj"

echo "aarch64 build: $("$CXX" --version | head -1); sysroot $SYSROOT; $OPT; $JOBS jobs" >&2

# --- protoc on the host -----------------------------------------------------
protoc --proto_path="$ROOT/proto" --cpp_out="$OUT/gen/proto" --grpc_out="$OUT/gen/proto" \
  --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" "$ROOT/proto/optimus.proto"

# --- compile ----------------------------------------------------------------
CXXFLAGS=(-std=c++17 $OPT -g0 -pthread -Wall -fPIC
          -I"$ROOT" -I"$OUT/gen"
          # Multiarch headers (openssl/opensslconf.h) the cross compiler does not search.
          -isystem "$SYSROOT/usr/include/aarch64-linux-gnu"
          $(pkg-config --cflags "${PC_LIB[@]}" "${PC_TEST[@]}" | sed "s|-I$SYSROOT|-isystem $SYSROOT|g"))

# Unique sources (the x86-64 ISA files among them compile to nothing off
# x86-64); each is compiled once into OUT/obj/<path with / as _>.o.
mapfile -t srcs < <(printf '%s\n' "${!COPTS[@]}" | sort)
obj_of() { local p="${1//\//_}"; echo "$OUT/obj/${p%.cc}.o"; }
src_path() { case "$1" in gen/*) echo "$OUT/$1" ;; *) echo "$ROOT/$1" ;; esac; }

compile_list="$OUT/obj/compile.txt"
: > "$compile_list"
for s in "${srcs[@]}"; do
  src="$(src_path "$s")"
  [ -f "$src" ] || fail "$s (from $MANIFEST) not found at $src"
  printf '%s\t%s\t%s\n' "$src" "$(obj_of "$s")" "${COPTS[$s]}" >> "$compile_list"
done
export CXX
export CXXFLAGS_STR="${CXXFLAGS[*]}"
# xargs exits non-zero when any compile fails; the compiler's errors show.
xargs -P "$JOBS" -d '\n' -n 1 bash -c '
  IFS=$'"'"'\t'"'"' read -r src obj extra <<< "$1"
  $CXX $CXXFLAGS_STR $extra -c "$src" -o "$obj" || { echo "aarch64 build: FAILED to compile $src" >&2; exit 1; }
' _ < "$compile_list" || fail "compilation failed"

# No fused multiply-add in the kernels (replicas must agree bit for bit
# with x86-64 primaries).
if aarch64-linux-gnu-objdump -d "$OUT"/obj/kernels_cpu_optimizer*.o 2>/dev/null |
    grep -qE '\s(fmla|fmls|fmadd|fmsub|fnmadd|fnmsub)\s'; then
  fail "fused multiply-add instructions in the aarch64 kernels"
fi

# --- link ---------------------------------------------------------------------
LIBDIRS="$SYSROOT/usr/lib/aarch64-linux-gnu:$SYSROOT/lib/aarch64-linux-gnu"
LDFLAGS=(-pthread -Wl,--as-needed -Wl,-rpath-link,"$LIBDIRS")
link() {  # link OUTPUT [-lextra...] pkg-config-modules... -- sources...
  local out="$1"; shift
  local mods=() objs=() extra=()
  while [[ "$1" == -l* ]]; do extra+=("$1"); shift; done
  while [ "$1" != "--" ]; do mods+=("$1"); shift; done
  shift
  for s in "$@"; do objs+=("$(obj_of "$s")"); done
  "$CXX" "${objs[@]}" -o "$out" "${LDFLAGS[@]}" "${extra[@]}" $(pkg-config --libs "${mods[@]}") ||
    fail "link of $(basename "$out") failed"
}
link "$OUT/optimus-shard" "${PC_LIB[@]}" -- ${TARGET_SRCS[optimus-shard]}
echo "aarch64 build: $OUT/optimus-shard: $(file -b "$OUT/optimus-shard" 2>/dev/null | cut -d, -f1-2)" >&2
if [ "$WITH_TESTS" = 1 ]; then
  rm -rf "$OUT/tests"
  mkdir -p "$OUT/tests"
  for t in "${TARGETS[@]}"; do
    [ "$t" != optimus-shard ] || continue
    # The cc_tests link -lgtest_main; it is a static archive beside libgtest.a.
    link "$OUT/tests/$t" -lgtest_main "${PC_LIB[@]}" "${PC_TEST[@]}" -- ${TARGET_SRCS[$t]}
  done
  echo "aarch64 build: tests in $OUT/tests: $(ls "$OUT/tests" | tr '\n' ' ')" >&2
fi
