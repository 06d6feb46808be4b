#!/usr/bin/env bash
# Makes a local certificate authority and the certificates a local optimus
# cluster needs, each in a folder laid out as a Kubernetes TLS Secret
# (ca.crt, tls.crt, tls.key) that --tls_dir / OPTIMUS_TLS_DIR take:
#
#   OUT/ca/           the CA (ca.key stays here; never hand it out)
#   OUT/coordinator/  server certificate for optimus-coord (localhost,
#                     127.0.0.1, ::1, every --host given and every host of
#                     --coordinators): one certificate every coordinator
#                     (a leader and its standbys) can serve with
#   OUT/shard-N/      client certificates "shard:shard-N", N = 0..shards-1
#   OUT/admin/        "admin:local" (optimusctl)
#   OUT/trainer/      "trainer:local" (may create jobs)
#   OUT/worker/       only ca.crt: a worker proves a job token instead
#
# Usage: make_local_ca.sh OUT [--shards N] [--host NAME]... [--coordinators LIST]
#   --coordinators takes the list the shards and workers are given
#   (HOST:PORT,HOST:PORT,...; [V6]:PORT for IPv6): TLS checks each
#   coordinator against the name it is dialled by, so every host is named.
# For a real cluster use your own CA (or cert-manager) with the same
# common names; see docs/operations.md "Security".
set -euo pipefail

usage() { echo "usage: $0 OUT [--shards N] [--host NAME]... [--coordinators HOST:PORT,...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
out=$1; shift
shards=4
hosts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --shards) shards=${2:?}; shift 2 ;;
    --host) hosts+=("${2:?}"); shift 2 ;;
    --coordinators)
      IFS=',' read -r -a entries <<<"${2:?}"
      for e in "${entries[@]}"; do
        e=${e// /}
        if [[ "$e" =~ ^\[([0-9A-Fa-f:.]+)\]:[0-9]+$ ]]; then
          hosts+=("${BASH_REMATCH[1]}")
        elif [[ "$e" =~ ^([A-Za-z0-9._-]+):[0-9]+$ ]]; then
          hosts+=("${BASH_REMATCH[1]}")
        else
          echo "$0: --coordinators: '$e' is not HOST:PORT (or [IPV6]:PORT)" >&2
          exit 2
        fi
      done
      shift 2 ;;
    *) usage ;;
  esac
done
command -v openssl >/dev/null || { echo "$0: openssl is missing (scripts/install_deps.sh)" >&2; exit 1; }

umask 077
mkdir -p "$out/ca"
days=825
if [ ! -f "$out/ca/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$out/ca/ca.key" -out "$out/ca/ca.crt" -days "$days" \
    -subj "/CN=optimus local CA" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

# issue NAME CN USAGE [SAN]
issue() {
  local dir="$out/$1" cn=$2 usage=$3 san=${4:-}
  mkdir -p "$dir"
  cp "$out/ca/ca.crt" "$dir/ca.crt"
  [ -f "$dir/tls.crt" ] && return 0
  local ext
  ext=$(mktemp)
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -n "$san" ] && echo "subjectAltName=$san"
  } >"$ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$dir/tls.key" -out "$dir/tls.csr" -subj "/CN=$cn" 2>/dev/null
  openssl x509 -req -in "$dir/tls.csr" -CA "$out/ca/ca.crt" -CAkey "$out/ca/ca.key" \
    -CAcreateserial -out "$dir/tls.crt" -days "$days" -extfile "$ext" 2>/dev/null
  rm -f "$dir/tls.csr" "$ext"
}

san="DNS:localhost,IP:127.0.0.1,IP:::1"
for h in "${hosts[@]}"; do
  case ",$san," in *",DNS:$h,"* | *",IP:$h,"*) continue ;; esac  # Named already.
  if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san="$san,IP:$h"; else san="$san,DNS:$h"; fi
done
issue coordinator "optimus-coordinator" "serverAuth,clientAuth" "$san"
for ((i = 0; i < shards; i++)); do issue "shard-$i" "shard:shard-$i" clientAuth; done
issue admin "admin:local" clientAuth
issue trainer "trainer:local" clientAuth
mkdir -p "$out/worker"
cp "$out/ca/ca.crt" "$out/worker/ca.crt"
echo "$out"
