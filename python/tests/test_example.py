"""The example (python/examples/train_gpt.py) on the local cluster: the main
job with --python_workers runs it as W=2 workers and its loss goes down."""

import json
import os
import subprocess

import cluster as cluster_mod


def test_local_cluster_runs_the_python_example(tmp_path):
    root = cluster_mod.bin_root()
    out = subprocess.run(
        [os.path.join(root, "deploy", "local", "local_cluster"), f"--bin_dir={root}",
         f"--work_dir={tmp_path}", "--python_workers", "--steps=60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=900)
    err = out.stderr.decode(errors="replace")
    assert out.returncode == 0, err[-3000:]
    summary = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert summary["python_workers"] is True and summary["workers"] == 2
    assert summary["steps"] == 60
    assert summary["final_loss"] < summary["initial_loss"], summary
    assert "2 Python workers" in err and "step 60/60" in err
