"""PyTorch integration: ``optimus.torch.DistributedOptimizer``, a
``torch.optim.Optimizer`` whose step runs on the optimus shards.

    import optimus.torch
    opt = optimus.torch.DistributedOptimizer(model.parameters(), lr=3e-4,
                                             weight_decay=0.1, model=model,
                                             max_grad_norm=1.0)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()      # gradients leave from autograd hooks
        opt.step()           # the shards step; pulls of the result start
        sched.step()         # any torch.optim.lr_scheduler
    opt.close()              # the model holds the final parameters
"""

from optimus.torch._optimizer import DistributedOptimizer, MODES  # noqa: F401

__all__ = ["DistributedOptimizer", "MODES"]
