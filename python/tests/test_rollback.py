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
