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
  golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev nodejs
  python3-kubernetes
  python3-torch
  clang lld
  nlohmann-json3-dev libcli11-dev
  libcpp-httplib-dev
  libyaml-cpp-dev
  libssl-dev openssl
  python3-dev pybind11-dev python3-pytest python3-yaml
  iproute2
  # etcd mode: /usr/bin/etcd for its tests (and a local cluster), and the
  # v3 API's .proto files, compiled at build time (bazel/etcd_api.bzl).
  etcd-server golang-etcd-server-dev
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

# The Helm chart test's node modules (versions pinned by
# deploy/helm/tests/package-lock.json), from the npm registry, once.
HELM_TESTS="$(cd "$(dirname "$0")/.." && pwd)/deploy/helm/tests"
if [ ! -d "$HELM_TESTS/node_modules/kubernetes-models" ]; then
  if ! command -v npm >/dev/null; then
    echo "install_deps: installing npm" >&2
    if [ "$(id -u)" != "0" ]; then NPM_SUDO="sudo"; else NPM_SUDO=""; fi
    DEBIAN_FRONTEND=noninteractive $NPM_SUDO apt-get install -y -q --no-install-recommends npm
  fi
  echo "install_deps: npm ci in deploy/helm/tests" >&2
  (cd "$HELM_TESTS" && npm ci --no-audit --no-fund --loglevel=error)
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

# The aarch64 cross build of optimus-shard (deploy/aarch64) links against
# Debian's arm64 grpc++/protobuf/UCX/abseil/gtest. They are unpacked into a
# sysroot (/opt/optimus-aarch64-sysroot) with apt's own private arm64 lists,
# not installed with dpkg --add-architecture: the arm64 -dev packages are
# Multi-Arch: same and would make apt upgrade installed amd64 packages to
# match. Removes and changes no installed package; returns at once when the
# sysroot is there. A failure here only leaves the aarch64 test failing.
"$(dirname "$0")/../deploy/aarch64/fetch_sysroot.sh" ||
  echo "install_deps: could not fetch the arm64 sysroot; //deploy/aarch64:aarch64_qemu_test will fail" >&2
