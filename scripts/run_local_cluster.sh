#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a small model on
# a local optimus cluster (coordinator + shard servers + workers on loopback).
# Extra arguments go to optimus-local-cluster, e.g. --steps=500 --shards=3;
# --python_workers runs the Python example (python/examples/train_gpt.py,
# optimus.torch.DistributedOptimizer) as the workers instead of the C++ ones.
# With an etcd you run, --etcd_endpoints=127.0.0.1:2379 --coordinators=2
# keeps the state there and starts a leader and a standby; every shard and
# worker is given both addresses and follows whichever leads
# (docs/operations.md "Two coordinators").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
bazel build -c opt //deploy/local:local_cluster //cli:optimusctl
exec bazel-bin/deploy/local/local_cluster --bin_dir="$(pwd)/bazel-bin" "$@"
