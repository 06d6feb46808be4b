#!/usr/bin/env bash
# Installs what optimus needs from Debian's packages, if missing. Idempotent:
# a machine that has everything spends a second here.
set -euo pipefail

PACKAGES=(
  bazel-bootstrap bazel-rules-java pkg-config g++
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libucx-dev ucx-utils libabsl-dev libgtest-dev libgmock-dev
  libtorch-dev python3
  g++-aarch64-linux-gnu binutils-aarch64-linux-gnu qemu-user
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}" >&2
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The CUDA kernels are compiled by nvcc (the machine image ships CUDA in
# /usr/local/cuda); without it the CUDA targets cannot build.
if [ ! -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  echo "install_deps: nvcc not found (expected /usr/local/cuda/bin/nvcc)." >&2
  echo "install_deps: trying Debian's nvidia-cuda-toolkit (needs the non-free component)" >&2
  DEBIAN_FRONTEND=noninteractive ${SUDO:-} apt-get install -y -q nvidia-cuda-toolkit || {
    echo "install_deps: no nvcc available; the CUDA kernels will not build" >&2
    exit 1
  }
fi
