#!/usr/bin/env bash
# Stages the binaries the Dockerfiles copy into a build context folder:
#
#   deploy/docker/stage.sh [--context=DIR] [--arm64-from=DIR] [--no-build]
#
#   --context     build context to fill (default: out/docker in this checkout)
#   --arm64-from  folder holding the cross-built arm64 optimus-shard, from
#                 deploy/aarch64/build.sh (default: out/aarch64); skipped with a
#                 warning when it has none, and the image is then amd64-only
#   --no-build    do not run bazel; copy what bazel-bin already holds
#
# Result: DIR/amd64/{optimus-shard,optimus-coord,optimusctl} and
# DIR/arm64/optimus-shard. Then build the images as deploy/docker/README.md says.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CONTEXT="$ROOT/out/docker"
ARM64_FROM="$ROOT/out/aarch64"
BUILD=1
for a in "$@"; do
  case "$a" in
    --context=*) CONTEXT="${a#--context=}" ;;
    --arm64-from=*) ARM64_FROM="${a#--arm64-from=}" ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "stage.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done

# The ELF machine of a binary: "X86-64" or "AArch64" (readelf; file(1) may be absent).
machine() { LC_ALL=C readelf -h "$1" 2>/dev/null | sed -n 's/^ *Machine: *//p'; }

cd "$ROOT"
if [ "$BUILD" = 1 ]; then
  bazel build -c opt //server:optimus-shard //coordinator:optimus-coord //cli:optimusctl
fi
BIN="$(bazel info -c opt bazel-bin 2>/dev/null || echo "$ROOT/bazel-bin")"
mkdir -p "$CONTEXT/amd64" "$CONTEXT/arm64"
for b in server/optimus-shard coordinator/optimus-coord cli/optimusctl; do
  [ -x "$BIN/$b" ] || { echo "stage.sh: $BIN/$b missing; run without --no-build" >&2; exit 1; }
  install -m 0755 "$BIN/$b" "$CONTEXT/amd64/"
done
machine "$CONTEXT/amd64/optimus-shard" | grep -q "X86-64" ||
  { echo "stage.sh: $CONTEXT/amd64/optimus-shard is not an x86-64 binary" >&2; exit 1; }

if [ -x "$ARM64_FROM/optimus-shard" ]; then
  machine "$ARM64_FROM/optimus-shard" | grep -q "AArch64" ||
    { echo "stage.sh: $ARM64_FROM/optimus-shard is not an aarch64 binary" >&2; exit 1; }
  install -m 0755 "$ARM64_FROM/optimus-shard" "$CONTEXT/arm64/"
else
  echo "stage.sh: warning: no $ARM64_FROM/optimus-shard; build it with deploy/aarch64/build.sh" >&2
  echo "stage.sh: warning: until then build the shard image for --platform linux/amd64 only" >&2
fi
echo "stage.sh: build context $CONTEXT:" >&2
(cd "$CONTEXT" && find . -type f | sort) >&2
