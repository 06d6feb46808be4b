#!/usr/bin/env bash
# Runs an aarch64 binary from deploy/aarch64/build.sh on an x86-64 host under
# qemu-aarch64 (user mode, no binfmt needed):
#
#   deploy/aarch64/qemu_run.sh out/aarch64/optimus-shard --helpfull
#
# glibc, libstdc++ and the dynamic loader come from the cross toolchain's
# /usr/aarch64-linux-gnu (libc6-arm64-cross); grpc++, protobuf, UCX, abseil
# from the arm64 sysroot (deploy/aarch64/fetch_sysroot.sh).
set -euo pipefail
if [ "$#" -lt 1 ]; then
  echo "usage: $0 AARCH64_BINARY [ARGS...]" >&2
  exit 2
fi
QEMU=""
for q in qemu-aarch64 qemu-aarch64-static; do
  if command -v "$q" >/dev/null; then QEMU="$q"; break; fi
done
[ -n "$QEMU" ] || { echo "qemu_run: qemu-aarch64 not found: apt-get install qemu-user (scripts/install_deps.sh)" >&2; exit 1; }
CROSS=/usr/aarch64-linux-gnu
[ -e "$CROSS/lib/ld-linux-aarch64.so.1" ] ||
  { echo "qemu_run: $CROSS/lib/ld-linux-aarch64.so.1 missing: apt-get install libc6-arm64-cross" >&2; exit 1; }
SYSROOT="${OPTIMUS_AARCH64_SYSROOT:-/opt/optimus-aarch64-sysroot}"
[ -d "$SYSROOT/usr/lib/aarch64-linux-gnu" ] ||
  { echo "qemu_run: no arm64 sysroot at $SYSROOT: run deploy/aarch64/fetch_sysroot.sh" >&2; exit 1; }
# qemu looks up the guest's absolute paths under -L first, then on the host:
# the loader resolves to $CROSS/lib, the sysroot's paths to themselves.
# -E sets LD_LIBRARY_PATH for the guest only, not for qemu itself.
exec "$QEMU" -L "$CROSS" \
  -E LD_LIBRARY_PATH="$SYSROOT/usr/lib/aarch64-linux-gnu:$SYSROOT/lib/aarch64-linux-gnu" "$@"
