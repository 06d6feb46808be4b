#!/usr/bin/env bash
# Fetches the arm64 (aarch64) libraries optimus-shard links against into a
# sysroot folder, for the cross build in deploy/aarch64/build.sh:
#   grpc++, protobuf, UCX, abseil, cpp-httplib, nlohmann-json, gtest/gmock
#   and what they link to.
#
# Why not `dpkg --add-architecture arm64` + `apt-get install libgrpc++-dev:arm64`:
# every one of these -dev packages is Multi-Arch: same, so the arm64 copy must
# have exactly the version of the installed amd64 one, and `apt-get install -s`
# shows apt upgrading some 15 amd64 packages to match (libssl3, openssl,
# libssl-dev, krb5, linux-libc-dev, e2fsprogs, ...) under everything else on
# the machine. So this uses apt with private state instead: its own arm64
# package lists and an empty dpkg status, `apt-get download`, then
# `dpkg-deb -x` into the sysroot. The installed packages and dpkg's database
# are never touched, and no foreign architecture is added.
#
# Idempotent: when the sysroot already holds this package list it returns at
# once, without the network. Usage: fetch_sysroot.sh [SYSROOT]
set -euo pipefail

SYSROOT="${1:-${OPTIMUS_AARCH64_SYSROOT:-/opt/optimus-aarch64-sysroot}}"
CACHE="${OPTIMUS_AARCH64_APT_CACHE:-/var/cache/optimus-arm64}"

# Libraries and headers (-dev) plus every shared library they need at link
# time (for -rpath-link) and at run time under qemu. libc, libstdc++ and
# libgcc come from the cross toolchain (libc6-arm64-cross & co.).
PACKAGES=(
  libgrpc++-dev libgrpc-dev libgrpc++1.51 libgrpc29
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc32
  libabsl-dev libabsl20220623
  libucx-dev libucx0 libibverbs1 librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200
  libre2-dev libre2-9 libc-ares-dev libc-ares2 libssl-dev libssl3 zlib1g-dev zlib1g
  libcpp-httplib-dev libcpp-httplib0.11 libbrotli-dev libbrotli1
  nlohmann-json3-dev
  libgtest-dev libgmock-dev
)
STAMP="$SYSROOT/.optimus-sysroot-packages"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "${PACKAGES[*]}" ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
echo "fetch_sysroot: fetching arm64 libraries into $SYSROOT" >&2
$SUDO mkdir -p "$CACHE/lists/partial" "$CACHE/cache/archives/partial" "$CACHE/debs"
$SUDO touch "$CACHE/empty-status"
APT=(apt-get -q
  -o APT::Architecture=arm64 -o APT::Architectures::=arm64
  -o Dir::State::Lists="$CACHE/lists" -o Dir::Cache="$CACHE/cache"
  -o Dir::State::status="$CACHE/empty-status"
  # Private lists, cache and status: the system's apt/dpkg locks guard
  # nothing this touches.
  -o Debug::NoLocking=1
  # apt-get download writes into the current folder, which its sandbox user
  # (_apt) cannot; root downloads them itself.
  -o APT::Sandbox::User=root)
$SUDO "${APT[@]}" update >&2 || {
  echo "fetch_sysroot: apt-get update for arm64 failed (network? /etc/apt/sources.list.d)" >&2
  exit 1
}
$SUDO rm -f "$CACHE"/debs/*.deb
(cd "$CACHE/debs" && $SUDO "${APT[@]}" download "${PACKAGES[@]}" >&2) || {
  echo "fetch_sysroot: apt-get download of the arm64 packages failed" >&2
  exit 1
}

# Unpack into a new folder, then swap it in: a half-made sysroot never
# carries the stamp.
NEW="$SYSROOT.new.$$"
$SUDO rm -rf "$NEW"
$SUDO mkdir -p "$NEW"
for deb in "$CACHE"/debs/*.deb; do
  $SUDO dpkg-deb -x "$deb" "$NEW"
done
# Absolute symlinks (libz.so -> /lib/aarch64-linux-gnu/...) would point at
# the host; point them into the sysroot.
while IFS= read -r link; do
  target="$(readlink "$link")"
  $SUDO ln -sfn "$SYSROOT$target" "$link"
done < <(find "$NEW" -type l -lname '/*')
echo "${PACKAGES[*]}" | $SUDO tee "$NEW/.optimus-sysroot-packages" >/dev/null
$SUDO rm -rf "$SYSROOT"
$SUDO mv "$NEW" "$SYSROOT"
echo "fetch_sysroot: $SYSROOT ready ($(du -sh "$SYSROOT" | cut -f1))" >&2
