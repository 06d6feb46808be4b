"""optimus.Client, the extension's binding of client::Client: buffers as
addresses, tickets, errors as exceptions with the status code."""

import pytest
import torch

import optimus


def test_one_step_by_hand(cluster):
    c = optimus.Client.connect(cluster.address, net_devices="lo")
    job = optimus.JobDef()
    job.name = "client-by-hand"
    job.world_size = 1
    job.tensors = [optimus.TensorDef("w", [3, 4]), optimus.TensorDef("b", [4])]
    job.optimizer.kind = "sgd"
    job.optimizer.lr = 0.5
    job.grad_dtype = "fp32"
    job.param_dtype = "fp32"
    c.create_job(job)
    with pytest.raises(optimus.AlreadyExists) as e:
        c.create_job(job)
    assert e.value.code == "ALREADY_EXISTS"
    c.join("client-by-hand", 0, 1)
    assert [t.name for t in c.tensors] == ["w", "b"] and c.resume_step == 1
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(4)
    c.init_tensor(0, w.data_ptr(), w.numel())
    c.init_tensor(1, b.data_ptr(), b.numel())
    g = torch.full((3, 4), 2.0)
    # Tensor 1 gets no gradient (address 0): it stays as it was.
    c.wait_all([c.push(0, 1, g.data_ptr(), g.numel()), c.push(1, 1, 0, 4)], 30)
    out_w, out_b = torch.empty(3, 4), torch.empty(4)
    c.wait_all([c.pull(0, 2, out_w.data_ptr(), 12), c.pull(1, 2, out_b.data_ptr(), 4)], 30)
    assert torch.equal(out_w, w - 0.5 * g)
    assert torch.equal(out_b, b)
    report = c.step_result(1, 30)
    assert report.grad_norm == pytest.approx(float(g.norm())) and not report.found_inf
    with pytest.raises(optimus.NotFound):
        c.wait(123456789, 1)
    with pytest.raises(optimus.InvalidArgument, match="steps start at 1"):
        c.push(0, 0, g.data_ptr(), 12)
    c.leave()
    c.close()
    with pytest.raises(optimus.FailedPrecondition, match="closed"):
        c.tensors


def test_job_spec_parser_errors_name_the_line(tmp_path):
    with pytest.raises(optimus.InvalidArgument, match=r"job.yaml:3: optimizer.params.lr"):
        p = tmp_path / "job.yaml"
        p.write_text("name: x\noptimizer:\n  params: {lr: fast}\n")
        optimus.load_job_config(str(p))
    cfg = optimus.parse_job_config('{"gradient_clipping": 1.5, "dtypes": {"grad": "fp32"}}')
    assert cfg.job.max_grad_norm == 1.5 and cfg.job.grad_dtype == "fp32"


def test_job_spec_model_preset_gives_its_tensors():
    cfg = optimus.parse_job_config("name: g\nmodel: gpt2-124m\n", "g.yaml")
    assert cfg.model == "gpt2-124m" and cfg.has_tensors
    total = 0
    for t in cfg.job.tensors:
        n = 1
        for d in t.shape:
            n *= d
        total += n
    assert total == 124439808  # GPT-2 124M with tied embeddings
    with pytest.raises(optimus.InvalidArgument, match=r"g.yaml:1: model: unknown model preset 'gpt5'"):
        optimus.parse_job_config("model: gpt5\n", "g.yaml")
