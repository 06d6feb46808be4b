"""Re-join after a rollback, inside the library: a job without replicas
loses a shard (SIGKILL); the coordinator restores it from its last
checkpoint under the same name, and the training loop - which only calls
forward, backward and step() - goes on from the checkpoint's step."""

import glob
import os
import time
import warnings

import torch

import cluster as cluster_mod
import optimus.torch
import task

torch.set_num_threads(1)


def test_step_rejoins_the_restored_job(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    c = cluster_mod.Cluster(shards=2, checkpoint_dir=str(ckpt), work_dir=str(tmp_path / "c"))
    try:
        model = task.make_model()
        opt = optimus.torch.DistributedOptimizer(
            model.parameters(), lr=1e-2, model=model, coordinator=c.address,
            job_name="rollback", checkpoint_every_steps=5, net_devices="lo", timeout_s=120)
        first_job = opt.client.job_id

        def train_step(step):
            x, y = task.full_batch(step, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss.item()

        # Train until a checkpoint is complete on disk (its MANIFEST written).
        step = 1
        while not glob.glob(os.path.join(ckpt, "rollback", "ckpt-*", "MANIFEST")):
            train_step(step)
            step += 1
            assert step < 500, "no checkpoint was completed"
            time.sleep(0.01)
        killed_at = opt.step_count
        c.kill_shard(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # Steps block until the failure is seen, then re-join and go on.
            losses = [train_step(s) for s in range(20)]
        assert any("re-joining" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert opt.client.job_id != first_job
        resumed = opt.client.resume_step
        assert 1 < resumed <= killed_at
        assert opt.step_count > resumed
        assert all(l == l and l < 10 for l in losses)  # finite: training went on
        opt.close()
    finally:
        c.stop()


def test_state_dict_holds_the_shards_moments(tmp_path):
    """state_dict() after 6 steps (W=1, fp32 on the wire): the moments and
    step counts torch.optim.AdamW holds after the same 6 steps (1e-5), and
    torch.optim.AdamW.load_state_dict takes it and steps on as the original
    torch run does."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    c = cluster_mod.Cluster(shards=2, checkpoint_dir=str(ckpt), work_dir=str(tmp_path / "c"))
    try:
        model = task.make_model()
        opt = optimus.torch.DistributedOptimizer(
            task.param_groups(model), lr=1e-2, model=model, coordinator=c.address,
            job_name="state-dict", grad_dtype="fp32", param_dtype="fp32", net_devices="lo")
        ref = task.make_model()
        ref_opt = torch.optim.AdamW(task.param_groups(ref), lr=1e-2, foreach=False)
        for step in range(1, 7):
            for m, o in ((model, opt), (ref, ref_opt)):
                x, y = task.full_batch(step, 1)
                o.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
        sd = opt.state_dict()
        want = ref_opt.state_dict()
        assert sorted(sd["state"]) == sorted(want["state"])  # "unused" never stepped: absent
        for i, st in want["state"].items():
            assert float(sd["state"][i]["step"]) == float(st["step"]) == 6
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(sd["state"][i][k], st[k], rtol=1e-4, atol=1e-7), (i, k)
        for name, p in ref.named_parameters():
            assert torch.allclose(sd["optimus"]["master"][name], p.detach(), atol=1e-5), name
        assert [g["weight_decay"] for g in sd["param_groups"]] == [task.WEIGHT_DECAY, 0.0]
        # A new job started from it (this class's load_state_dict, masters
        # included; the model's own values are not used) steps on like the
        # original too.
        moved = task.make_model(seed=5)
        moved_opt = optimus.torch.DistributedOptimizer(
            task.param_groups(moved), lr=1e-2, model=moved, coordinator=c.address,
            job_name="state-dict-moved", grad_dtype="fp32", param_dtype="fp32",
            net_devices="lo")
        moved_opt.load_state_dict(sd)
        for step in range(7, 10):
            x, y = task.full_batch(step, 1)
            moved_opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(moved(x), y).backward()
            moved_opt.step()
        moved_opt.close()
        # torch.optim.AdamW takes it and steps on like the original.
        again = task.make_model()
        again.load_state_dict(ref.state_dict())
        again_opt = torch.optim.AdamW(task.param_groups(again), lr=1e-2, foreach=False)
        again_opt.load_state_dict(sd)
        for step in range(7, 10):
            for m, o in ((again, again_opt), (ref, ref_opt)):
                x, y = task.full_batch(step, 1)
                o.zero_grad(set_to_none=True)
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
        for (n, a), b, c2 in zip(again.named_parameters(), ref.parameters(),
                                 moved.parameters()):
            assert torch.allclose(a, b, atol=1e-5), n
            assert torch.allclose(c2, b, atol=1e-5), n
        # Training goes on after the checkpoint.
        x, y = task.full_batch(7, 1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.close()
    finally:
        c.stop()
