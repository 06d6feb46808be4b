"""DistributedOptimizer's setup and bad inputs, in this process (W=1 jobs, or
two optimizers of one job in one process), against the session's cluster."""

import copy

import pytest
import torch

import optimus
import optimus.torch
import task

torch.set_num_threads(1)


def make(cluster, model, job, **kw):
    kw.setdefault("net_devices", "lo")
    kw.setdefault("join_timeout_s", 10)
    return optimus.torch.DistributedOptimizer(
        model.parameters(), lr=1e-2, model=model, coordinator=cluster.address, job_name=job,
        **kw)


def test_unknown_job_times_out_naming_it(cluster):
    """A rank other than 0 waits for rank 0 to create the job, then gives up
    naming the job and the coordinator's last answer."""
    with pytest.raises(optimus.DeadlineExceeded, match="could not join job 'no-such-job'.*NOT_FOUND"):
        make(cluster, task.make_model(), "no-such-job", rank=1, world_size=2,
             join_timeout_s=1)


def test_wrong_world_size_is_refused(cluster):
    model = task.make_model()
    opt = make(cluster, model, "api-world", rank=0, world_size=2)
    with pytest.raises(optimus.OptimusError, match="world"):
        make(cluster, task.make_model(), "api-world", rank=1, world_size=3)
    opt.close(leave=False)


def test_other_parameters_than_the_job_are_refused(cluster):
    """Joining a job created for another model: FailedPrecondition naming the
    first tensor that differs."""
    opt = make(cluster, task.make_model(), "api-params", rank=0, world_size=2)
    other = torch.nn.Sequential(torch.nn.Linear(3, 5))
    with pytest.raises(optimus.FailedPrecondition,
                       match=r"has tensor 0 'fc1.weight' \[48,16\], this trainer's is '0.weight'"):
        make(cluster, other, "api-params", rank=1, world_size=2)
    opt.close(leave=False)


def test_arguments_are_checked(cluster):
    model = task.make_model()
    with pytest.raises(ValueError, match="mode"):
        make(cluster, model, "api-args", mode="fast")
    with pytest.raises(ValueError, match="coordinator"):
        optimus.torch.DistributedOptimizer(model.parameters(), model=model, coordinator="")
    with pytest.raises(ValueError, match="rank"):
        make(cluster, model, "api-args", rank=2, world_size=2)
    with pytest.raises(ValueError, match="not a parameter of model"):
        optimus.torch.DistributedOptimizer(torch.nn.Linear(2, 2).parameters(), model=model,
                                           coordinator=cluster.address)


def test_environment_sets_rank_world_and_coordinator(cluster, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("OPTIMUS_COORDINATOR", cluster.address)
    monkeypatch.setenv("OPTIMUS_JOB", "api-env")
    model = task.make_model()
    opt = optimus.torch.DistributedOptimizer(model.parameters(), model=model, net_devices="lo")
    assert opt.job_name == "api-env"
    assert opt.client.world_size == 1 and opt.client.rank == 0
    x, y = task.batch(1, 0, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert opt.step_count == 2
    opt.close()


def run_torch(model, opt, steps, first=1):
    for step in range(first, first + steps):
        x, y = task.full_batch(step, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def test_load_state_dict_starts_the_job_from_torch_adamw(cluster):
    """A run moving from torch.optim.AdamW onto optimus: 5 steps with torch,
    then model.load_state_dict + opt.load_state_dict into a new job (fp32 on
    the wire), 5 more steps: the same parameters as 10 torch steps (moments
    and per-parameter step counts carried over; 1e-5)."""
    ref = task.make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    run_torch(ref, ref_opt, 5)
    saved_model = {k: v.clone() for k, v in ref.state_dict().items()}
    saved_opt = copy.deepcopy(ref_opt.state_dict())  # state_dict() shares the live moments
    run_torch(ref, ref_opt, 5, first=6)

    model = task.make_model()
    model.load_state_dict(saved_model)
    opt = make(cluster, model, "api-load-state", grad_dtype="fp32", param_dtype="fp32")
    opt.load_state_dict(saved_opt)
    run_torch(model, opt, 5, first=6)
    opt.close()
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert (a - b).abs().max().item() < 1e-5, n
    # Without the moments (a fresh AdamW from the same weights) it would differ.
    fresh = task.make_model()
    fresh.load_state_dict(saved_model)
    run_torch(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=False), 5, first=6)
    assert max((a - b).abs().max().item() for a, b in
               zip(fresh.state_dict().values(), ref.state_dict().values())) > 1e-3


def test_load_state_dict_refuses_other_optimizers_state(cluster):
    model = task.make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run_torch(model, sgd, 1)
    opt = make(cluster, model, "api-load-sgd")
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(sgd.state_dict())
    opt.close(leave=False)


def test_step_report_and_loss_scale(cluster):
    """max_grad_norm: grad_norm is clip_grad_norm_'s value (here W=1, fp32);
    a loss scale is undone on the shards; an inf gradient is reported
    (found_inf) and the step skipped, parameters unchanged."""
    model = task.make_model()
    ref = task.make_model()
    opt = make(cluster, model, "api-report", grad_dtype="fp32", param_dtype="fp32",
               max_grad_norm=0.1, loss_scale=1024.0)
    x, y = task.full_batch(1, 1)
    (torch.nn.functional.mse_loss(model(x), y) * 1024.0).backward()
    opt.step()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert opt.grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert opt.last_step_report.clip_coef < 1 and not opt.last_step_report.found_inf

    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.synchronize()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(x)
    loss = (out * float("inf")).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    report = opt.last_step_report
    assert report.found_inf and report.skipped
    opt.synchronize()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    opt.close()


def test_config_file_sets_groups_and_clipping(cluster, tmp_path):
    """A DeepSpeed-style YAML job spec: optimizer, clipping, dtypes and
    parameter groups matched by name."""
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: api-config\n"
        "optimizer:\n"
        "  type: AdamW\n"
        "  params: {lr: 0.002, betas: [0.8, 0.9], weight_decay: 0.05}\n"
        "gradient_clipping: 0.7\n"
        "dtypes: {grad: fp32, param: bf16}\n"
        "param_groups:\n"
        "  - {name: no_decay, match: ['*.bias'], weight_decay: 0}\n"
        "  - {name: decay}\n")
    model = task.make_model()
    opt = optimus.torch.DistributedOptimizer(model.parameters(), model=model,
                                             coordinator=cluster.address, config=str(spec),
                                             net_devices="lo")
    assert opt.job_name == "api-config"
    assert [g["name"] for g in opt.param_groups] == ["no_decay", "decay"]
    assert all(n.endswith(".bias") for n, p in model.named_parameters()
               if any(p is q for q in opt.param_groups[0]["params"]))
    # (The spec's numbers are fp32, as the shards keep them.)
    assert opt.param_groups[0]["weight_decay"] == 0
    assert opt.param_groups[1]["weight_decay"] == pytest.approx(0.05)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.002)
    assert opt.param_groups[1]["betas"] == pytest.approx((0.8, 0.9))
    assert opt.grad_norm is None  # No step yet.
    assert opt._max_grad_norm == pytest.approx(0.7)
    assert opt.client.grad_dtype == "fp32" and opt.client.param_dtype == "bf16"
    opt.close()
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizr: {type: adamw}\n")
    with pytest.raises(ValueError, match="optimizr: unknown field"):
        optimus.torch.DistributedOptimizer(model.parameters(), model=model,
                                           coordinator=cluster.address, config=str(bad))


def test_delayed_mode_uses_the_parameters_of_the_step_before(cluster):
    """mode="delayed": the forward of step t+1 uses the parameters after step
    t-1 (version t). Against torch.optim.AdamW fed gradients computed on
    those stale parameters (fp32 on the wire, W=1): the same final
    parameters to 1e-5, and the losses seen are the stale ones."""
    steps = 8
    model = task.make_model()
    opt = make(cluster, model, "api-delayed", mode="delayed", grad_dtype="fp32",
               param_dtype="fp32")
    losses = []
    for step in range(1, steps + 1):
        x, y = task.full_batch(step, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt.close()  # Brings the model to version steps + 1.

    master = task.make_model()
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-2, foreach=False)
    versions = {1: copy.deepcopy(master.state_dict())}
    stale = task.make_model()
    ref_losses = []
    for step in range(1, steps + 1):
        stale.load_state_dict(versions[max(1, step - 1)])
        x, y = task.full_batch(step, 1)
        loss = torch.nn.functional.mse_loss(stale(x), y)
        stale.zero_grad(set_to_none=True)
        loss.backward()
        for p, q in zip(master.parameters(), stale.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        ref_opt.step()
        versions[step + 1] = copy.deepcopy(master.state_dict())
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, v in model.state_dict().items():
        assert torch.allclose(v, versions[steps + 1][n], atol=1e-5), n


def test_gradient_accumulation(cluster):
    """backward_passes_per_step=2: two micro-batches accumulate in .grad and
    the sum is pushed once (W=1, fp32), as torch.optim.AdamW after two
    backward passes."""
    model, ref = task.make_model(), task.make_model()
    opt = make(cluster, model, "api-accumulate", grad_dtype="fp32", param_dtype="fp32",
               backward_passes_per_step=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(1, 5):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad(set_to_none=True)
            for half in range(2):
                x, y = task.batch(step, half, 2)
                torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    opt.close()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=1e-5), n


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            line = f.read()
    except OSError:
        return ""
    return line[line.find("[") + 1:line.find("]")] if "[" in line else ""


def _huge_page_eligible(address):
    """'THPeligible: 1' for the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    return False


def test_staging_arenas_are_huge_page_eligible(cluster):
    """The arenas the client sends from and receives into start on a 2 MiB
    boundary and are advised for transparent huge pages (over 4 KiB pages
    every shared-memory transfer walks and pins each page); training through
    them equals torch.optim.SGD (SGD: a step that no rounding of a tiny
    gradient can turn around, unlike Adam's first steps)."""
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are '{_thp_mode()}' here")
    torch.manual_seed(3)
    model = torch.nn.Linear(1024, 1536)  # 1.57 M parameters: 6 MiB in fp32.
    ref = copy.deepcopy(model)
    w0 = model.weight.detach().clone()
    opt = make(cluster, model, "api-huge-pages", optimizer="sgd", grad_dtype="fp32",
               param_dtype="fp32")
    try:
        assert len(opt._arenas) == 2
        for a in opt._arenas:
            assert a.numel() * a.element_size() >= 6 << 20
            assert a.data_ptr() % (2 << 20) == 0
            assert _huge_page_eligible(a.data_ptr())
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
        x = torch.randn(16, 1024)
        for m, o in ((model, opt), (ref, ref_opt)):
            for _ in range(3):
                o.zero_grad(set_to_none=True)
                (m(x).pow(2).sum() / 100).backward()
                o.step()
    finally:
        opt.close()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a - b).abs().max().item() < 1e-6
    assert (model.weight.detach() - w0).abs().max().item() > 1e-4  # It trained.
