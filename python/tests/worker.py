#!/usr/bin/python3
"""One rank of the tests' W=2 training (task.py) with DistributedOptimizer.
Rank, world size and the coordinator come from $RANK, $WORLD_SIZE and
$OPTIMUS_COORDINATOR as torchrun would set them. Rank 0 saves the final
model and each step's loss and grad norm with torch.save to --out."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import optimus.torch  # noqa: E402
import task  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mode", default="layerwise")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    model = task.make_model()
    initial_eval = task.eval_loss(model, world)
    opt = optimus.torch.DistributedOptimizer(
        task.param_groups(model), lr=task.LR, betas=task.BETAS, eps=task.EPS,
        model=model, job_name=args.job, max_grad_norm=task.MAX_GRAD_NORM,
        grad_dtype=args.dtype, param_dtype=args.dtype, mode=args.mode, net_devices="lo")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, task.schedule(args.steps))
    losses, norms, lrs = [], [], []
    for step in range(1, args.steps + 1):
        x, y = task.batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        norms.append(opt.grad_norm)
        losses.append(loss.item())
        sched.step()
    opt.close()
    if rank == 0:
        torch.save({"model": model.state_dict(), "losses": losses, "norms": norms, "lrs": lrs,
                    "eval_loss": task.eval_loss(model, world),
                    "initial_eval_loss": initial_eval}, args.out)


if __name__ == "__main__":
    main()
