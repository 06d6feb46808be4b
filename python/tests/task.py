"""The small training task the tests run with DistributedOptimizer and with
torch.optim.AdamW: an MLP regressing a fixed random function, a warmup +
cosine LambdaLR, two parameter groups (no weight decay on biases), and
clipping. Deterministic: the same seed gives the same model and data."""

import math

import torch

IN, HIDDEN, OUT = 16, 48, 4
BATCH_PER_RANK = 32
LR = 1e-2
BETAS = (0.9, 0.98)
EPS = 1e-8
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 0.3
WARMUP = 5


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.unused = torch.nn.Linear(2, 2)  # Never called: no gradient.

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(seed=1):
    torch.manual_seed(seed)
    return Mlp()


def param_groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def schedule(total_steps):
    def f(s):  # s = scheduler.last_epoch: 0 for the first step.
        if s < WARMUP:
            return (s + 1) / WARMUP
        t = (s - WARMUP) / max(1, total_steps - WARMUP)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


_TRUE = None


def batch(step, rank, world):
    """Rank `rank`'s half of step `step`'s batch (the full batch is the ranks'
    halves concatenated in rank order)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH_PER_RANK * world, IN, generator=g)
    w = 0.3 * torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    y = torch.sin(x @ w) + 0.05 * torch.randn(BATCH_PER_RANK * world, OUT, generator=g)
    lo = rank * BATCH_PER_RANK
    return x[lo:lo + BATCH_PER_RANK], y[lo:lo + BATCH_PER_RANK]


def full_batch(step, world):
    xs, ys = zip(*(batch(step, r, world) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def eval_loss(model, world):
    with torch.no_grad():
        x, y = full_batch(10_000, world)
        return torch.nn.functional.mse_loss(model(x), y).item()


def reference(steps, world, seed=1):
    """The same training in one process: torch.optim.AdamW over the full batch
    with clip_grad_norm_. Returns (model, [grad norms])."""
    model = make_model(seed)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps))
    norms = []
    for step in range(1, steps + 1):
        x, y = full_batch(step, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
        opt.step()
        sched.step()
    return model, norms
