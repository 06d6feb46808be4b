"""DistributedOptimizer trains like torch.optim.AdamW: W=2 worker processes
(RANK / WORLD_SIZE / OPTIMUS_COORDINATOR as torchrun sets them), each on its
half of every batch, against the same training in one process over the full
batch with torch.optim.AdamW and clip_grad_norm_, under a warmup + cosine
LambdaLR with two parameter groups (no weight decay on biases)."""

import os
import subprocess
import sys

import pytest
import torch

import cluster as cluster_mod
import task

torch.set_num_threads(1)

STEPS = 40
WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))
_runs = {}


def train(cluster, mode, dtype, tmp_path_factory):
    """Runs the W=2 job once per (mode, dtype) and returns rank 0's result."""
    key = (mode, dtype)
    if key in _runs:
        return _runs[key]
    out = str(tmp_path_factory.mktemp(f"{mode}-{dtype}") / "result.pt")
    job = f"pytest-{mode}-{dtype}"
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD),
                   OPTIMUS_COORDINATOR=cluster.address,
                   PYTHONPATH=cluster_mod.python_path())
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "worker.py"), f"--job={job}",
             f"--steps={STEPS}", f"--mode={mode}", f"--dtype={dtype}", f"--out={out}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{logs[rank][-3000:]}"
    _runs[key] = torch.load(out)
    return _runs[key]


@pytest.fixture(scope="module")
def ref():
    model, norms = task.reference(STEPS, WORLD)
    return {"model": model.state_dict(), "norms": norms,
            "eval_loss": task.eval_loss(model, WORLD)}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_layerwise_bf16_matches_torch_adamw(cluster, ref, tmp_path_factory):
    """bf16 gradients and parameters on the wire: every final parameter
    within 2e-2 of torch.optim.AdamW's fp32 training (a few bf16 ulps of
    these weights, whose magnitudes are up to ~1: bf16 keeps 8 bits;
    measured 6e-3), the final loss within 2%, and the shards'
    clip_grad_norm_ norms within 2% (measured 0.3%)."""
    got = train(cluster, "layerwise", "bf16", tmp_path_factory)
    assert max_diff(got["model"], ref["model"]) < 2e-2
    assert abs(got["eval_loss"] - ref["eval_loss"]) < 0.02 * ref["eval_loss"]
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= 0.02 * b + 1e-3, (got["norms"], ref["norms"])
    # Clipping was active on some steps, and training worked.
    assert any(n > task.MAX_GRAD_NORM for n in ref["norms"])
    assert got["eval_loss"] < 0.8 * got["initial_eval_loss"]
    # The never-used layer got no gradient: untouched (no weight decay), as torch leaves it.
    init = task.make_model().state_dict()
    assert torch.equal(got["model"]["unused.weight"],
                       init["unused.weight"].to(torch.bfloat16).float())


def test_layerwise_fp32_matches_torch_adamw_closely(cluster, ref, tmp_path_factory):
    """fp32 on the wire: the same training to 1e-5 (measured 8e-7: the
    half-batch average and torch's fused multiply-adds differ in the last
    bits of fp32 per step)."""
    got = train(cluster, "layerwise", "fp32", tmp_path_factory)
    assert max_diff(got["model"], ref["model"]) < 1e-5
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= 1e-5 * b


def test_scheduler_lr_reaches_the_shards(cluster, ref, tmp_path_factory):
    """The lr each push carried is the LambdaLR's, per group (warmup then cosine)."""
    got = train(cluster, "layerwise", "bf16", tmp_path_factory)
    f = task.schedule(STEPS)
    for s, lrs in enumerate(got["lrs"]):
        assert lrs == pytest.approx([task.LR * f(s)] * 2, rel=1e-6)


def test_none_mode_equals_layerwise(cluster, tmp_path_factory):
    """No overlap (push all in step(), pull all before forward): the very same
    parameters as the layerwise hooks give."""
    a = train(cluster, "layerwise", "bf16", tmp_path_factory)
    b = train(cluster, "none", "bf16", tmp_path_factory)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["losses"] == b["losses"]


def test_delayed_mode_loss_close_to_exact(cluster, ref, tmp_path_factory):
    """One step of staleness: the final loss within 15% of exact training
    (margin stated in the README), and training still converges."""
    exact = train(cluster, "layerwise", "bf16", tmp_path_factory)
    delayed = train(cluster, "delayed", "bf16", tmp_path_factory)
    print("eval loss: exact", exact["eval_loss"], "delayed", delayed["eval_loss"],
          "initial", exact["initial_eval_loss"])
    assert delayed["eval_loss"] <= 1.15 * exact["eval_loss"], (delayed["eval_loss"],
                                                              exact["eval_loss"])
    assert delayed["eval_loss"] < 0.8 * delayed["initial_eval_loss"]
    # It is really stale: not the exact run's numbers.
    assert delayed["losses"] != exact["losses"]
