#!/usr/bin/env bash
# Makes a local certificate authority and the certificates a local optimus
# cluster needs, each in a folder laid out as a Kubernetes TLS Secret
# (ca.crt, tls.crt, tls.key) that --tls_dir / OPTIMUS_TLS_DIR take:
#
#   OUT/ca/           the CA (ca.key stays here; never hand it out)
#   OUT/coordinator/  server certificate for optimus-coord (localhost,
#                     127.0.0.1, ::1 and every --host given)
#   OUT/shard-N/      client certificates "shard:shard-N", N = 0..shards-1
#   OUT/admin/        "admin:local" (optimusctl)
#   OUT/trainer/      "trainer:local" (may create jobs)
#   OUT/worker/       only ca.crt: a worker proves a job token instead
#
# Usage: make_local_ca.sh OUT [--shards N] [--host NAME]...
# For a real cluster use your own CA (or cert-manager) with the same
# common names; see docs/operations.md "Security".
set -euo pipefail

usage() { echo "usage: $0 OUT [--shards N] [--host NAME]..." >&2; exit 2; }
[ $# -ge 1 ] || usage
out=$1; shift
shards=4
hosts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --shards) shards=${2:?}; shift 2 ;;
    --host) hosts+=("${2:?}"); shift 2 ;;
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
  if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san="$san,IP:$h"; else san="$san,DNS:$h"; fi
done
issue coordinator "optimus-coordinator" "serverAuth,clientAuth" "$san"
for ((i = 0; i < shards; i++)); do issue "shard-$i" "shard:shard-$i" clientAuth; done
issue admin "admin:local" clientAuth
issue trainer "trainer:local" clientAuth
mkdir -p "$out/worker"
cp "$out/ca/ca.crt" "$out/worker/ca.crt"
echo "$out"
