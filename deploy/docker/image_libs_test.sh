#!/usr/bin/env bash
# Checks that each image installs the runtime libraries its binaries need:
# every shared library the Bazel-built binary resolves (ldd) must come from a
# Debian package that the Dockerfile installs (or one apt pulls in as its
# dependency), or that debian:bookworm-slim already has. The package names are the same on amd64 and arm64, so this also
# covers the arm64 shard image. Also checks that the Dockerfiles put the
# binaries where the Helm chart runs them (/usr/local/bin), and that the check
# itself fails on a Dockerfile with a library package removed.
set -uo pipefail

die() {
  echo "image_libs_test: FAIL: $*" >&2
  exit 1
}
command -v ldd >/dev/null && command -v dpkg >/dev/null || die "needs ldd and dpkg (Debian)"

# Essential packages of debian:bookworm-slim that provide shared libraries.
BASE_PACKAGES="libc6 libgcc-s1 libstdc++6 zlib1g"

# Packages named on the apt-get install lines of a Dockerfile.
installed_packages() {
  sed -n '/apt-get install/,/rm -rf \/var\/lib\/apt\/lists/p' "$1" |
    tr ' \\' '\n\n' | grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -vE '^(apt-get|install|rm|DEBIAN_FRONTEND.*)$'
}

# Depends and Pre-Depends of every installed package, read once.
declare -A DEPENDS=()
while read -r pkg deps; do
  DEPENDS[$pkg]=$deps
done < <(dpkg-query -W -f='${Package} ${Depends}, ${Pre-Depends}\n' |
  sed -E 's/\([^)]*\)//g; s/[,|]/ /g; s/:any//g')

# The packages apt installs for the names given: the names and, recursively,
# their Depends and Pre-Depends (every alternative of an "a | b" counts), as
# this machine's dpkg database records them.
dependency_closure() {
  local -A seen=()
  local -a queue=("$@")
  local p d
  while [ "${#queue[@]}" -gt 0 ]; do
    p=${queue[0]}
    queue=("${queue[@]:1}")
    [ -z "${seen[$p]:-}" ] || continue
    seen[$p]=1
    for d in ${DEPENDS[$p]:-}; do
      [ -n "${seen[$d]:-}" ] || queue+=("$d")
    done
  done
  echo "${!seen[@]}"
}

# Prints the libraries of binary $1 whose package Dockerfile $2 does not install.
missing_for() {
  local bin=$1 dockerfile=$2 have lib path real pkg c i line out=""
  # shellcheck disable=SC2046
  have=" $(dependency_closure $BASE_PACKAGES $(installed_packages "$dockerfile")) "
  if ldd "$bin" | grep -q "not found"; then
    echo "unresolved: $(ldd "$bin" | grep "not found" | tr -s ' \t' ' ')"
    return
  fi
  declare -A owner=()
  local -a libs=() reals=() candidates=()
  while read -r lib path; do
    libs+=("$lib")
    real=$(readlink -f "$path")
    reals+=("$real")
    # dpkg knows a file by the path its package ships: /lib/... or /usr/lib/...
    # (merged /usr makes both resolve to the same file).
    candidates+=("$path" "$real" "${real#/usr}" "/usr${path#/usr}")
  done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
  # One dpkg call for all files: "package[:arch]: /path" per line.
  while IFS= read -r line; do
    pkg=${line%%: *}
    owner["${line#*: }"]=${pkg%%:*}
  done < <(dpkg -S "${candidates[@]}" 2>/dev/null)
  for i in "${!libs[@]}"; do
    real=${reals[$i]}
    pkg=""
    for c in "${candidates[@]:$((4 * i)):4}"; do
      pkg=${owner[$c]:-}
      [ -z "$pkg" ] || break
    done
    [ -n "$pkg" ] || { out+="${libs[$i]} (no Debian package owns $real) "; continue; }
    [[ "$have" == *" $pkg "* ]] || out+="${libs[$i]} (package $pkg) "
  done
  echo "$out"
}

check() {
  local bin=$1 dockerfile=$2 name missing n
  name=$(basename "$bin")
  missing=$(missing_for "$bin" "$dockerfile")
  [ -z "${missing// /}" ] || die "$(basename "$dockerfile") does not install what $name needs: $missing"
  grep -q "/usr/local/bin/$name" "$dockerfile" || die "$(basename "$dockerfile") does not put $name in /usr/local/bin"
  n=$(ldd "$bin" | awk '$2 == "=>"' | wc -l)
  echo "$(basename "$dockerfile"): $name's $n shared libraries are all installed"
}

SHARD_DF=deploy/docker/shard.Dockerfile
COORD_DF=deploy/docker/coord.Dockerfile
check server/optimus-shard "$SHARD_DF"
check coordinator/optimus-coord "$COORD_DF"
check cli/optimusctl "$COORD_DF"

grep -q 'COPY .*\${TARGETARCH}/optimus-shard' "$SHARD_DF" || die "shard.Dockerfile does not copy \${TARGETARCH}/optimus-shard"
grep -q 'ENTRYPOINT \["/usr/local/bin/optimus-shard"\]' "$SHARD_DF" || die "shard.Dockerfile's entrypoint is not optimus-shard"
grep -q 'ENTRYPOINT \["/usr/local/bin/optimus-coord"\]' "$COORD_DF" || die "coord.Dockerfile's entrypoint is not optimus-coord"
grep -q '^USER 65532' "$SHARD_DF" && grep -q '^USER 65532' "$COORD_DF" || die "the images must run as user 65532 (the chart's runAsUser)"

# The check must be able to fail: drop UCX from a copy of the shard Dockerfile.
TMP="${TEST_TMPDIR:-$(mktemp -d)}"
sed 's/libucx0 //' "$SHARD_DF" >"$TMP/no-ucx.Dockerfile"
missing=$(missing_for server/optimus-shard "$TMP/no-ucx.Dockerfile")
[[ "$missing" == *"libucx0"* ]] || die "removing libucx0 from the Dockerfile went unnoticed (got: '$missing')"
echo "a shard Dockerfile without libucx0 is caught: $missing"
# And the HTTP server's library (/metrics, /healthz) in the coordinator's.
sed 's/libcpp-httplib0.11 //' "$COORD_DF" >"$TMP/no-httplib.Dockerfile"
missing=$(missing_for coordinator/optimus-coord "$TMP/no-httplib.Dockerfile")
[[ "$missing" == *"libcpp-httplib0.11"* ]] ||
  die "removing libcpp-httplib0.11 from the Dockerfile went unnoticed (got: '$missing')"
echo "a coordinator Dockerfile without libcpp-httplib0.11 is caught: $missing"
echo "image_libs_test: PASS"
