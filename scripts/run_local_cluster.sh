#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains a small model on
# a local optimus cluster (coordinator + shard servers + workers on loopback).
# Extra arguments go to optimus-local-cluster, e.g. --steps=500 --shards=3;
# --python_workers runs the Python example (python/examples/train_gpt.py,
# optimus.torch.DistributedOptimizer) as the workers instead of the C++ ones.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
bazel build -c opt //deploy/local:local_cluster //cli:optimusctl
exec bazel-bin/deploy/local/local_cluster --bin_dir="$(pwd)/bazel-bin" "$@"
