#!/usr/bin/python3
"""A small GPT-style language model in plain PyTorch, trained on synthetic
data (nothing is downloaded) with optimus: the optimizer runs on the shard
servers, this process only pushes gradients and pulls parameters.

Compared with the same script on torch.optim.AdamW, optimus adds the lines
marked "# optimus" (pass --torch to run the plain torch.optim.AdamW version):

    import optimus.torch                                          # optimus
    opt = optimus.torch.DistributedOptimizer(groups, lr=..., model=model,
                                             max_grad_norm=1.0)   # optimus
    ...
    opt.close()                                                   # optimus

and no clip_grad_norm_ (the shards clip the global norm). Rank, world size
and the coordinator come from $RANK, $WORLD_SIZE (as torchrun sets them)
and $OPTIMUS_COORDINATOR (host:port, or a comma-separated list of a
leader and its standbys); each rank trains on its own batches. Rank 0
prints one JSON object per step and a summary (the local cluster reads
them: `scripts/run_local_cluster.sh --python_workers`).
"""

import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, ctx):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads
        self.register_buffer("mask", torch.tril(torch.ones(ctx, ctx, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    def __init__(self, vocab=64, ctx=32, d=64, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.Sequential(*[Block(d, heads, ctx) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.head(self.ln_f(x))


def batch(step, rank, size, vocab, ctx):
    """Synthetic sequences: each repeats a random motif of 4-8 tokens, so the
    next token is predictable from the context (attention learns to copy)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    seqs = []
    for _ in range(size):
        n = int(torch.randint(4, 9, (1,), generator=g))
        motif = torch.randint(0, vocab, (n,), generator=g)
        seqs.append(motif.repeat(ctx // n + 2)[:ctx + 1])
    data = torch.stack(seqs)
    return data[:, :-1], data[:, 1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--mode", default="layerwise", help="layerwise, delayed or none")
    ap.add_argument("--job", default=os.environ.get("OPTIMUS_JOB", "gpt-example"))
    ap.add_argument("--torch", action="store_true", help="plain torch.optim.AdamW, one process")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(args.seed)  # Every rank builds the same model (rank 0's values win).
    model = Gpt()
    vocab, ctx = model.tok.num_embeddings, model.pos.num_embeddings
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "pos" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "pos" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if args.torch:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    else:
        import optimus.torch  # optimus
        opt = optimus.torch.DistributedOptimizer(groups, lr=args.lr, betas=(0.9, 0.95),  # optimus
                                                 model=model, max_grad_norm=1.0,
                                                 mode=args.mode, job_name=args.job)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / args.steps))))

    losses, step_ms = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = batch(step, rank, args.batch, vocab, ctx)
        loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.torch:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        if rank == 0:
            print(json.dumps({"event": "step", "step": step, "steps": args.steps,
                              "loss": round(losses[-1], 6), "step_ms": round(step_ms[-1], 3)}),
                  flush=True)
    if not args.torch:
        opt.close()  # optimus: the model gets the last step's parameters; leaves the job.
    if rank == 0:
        tail = max(1, args.steps // 10)
        print(json.dumps({"event": "done", "steps": args.steps,
                          "initial_loss": round(sum(losses[:tail]) / tail, 6),
                          "final_loss": round(sum(losses[-tail:]) / tail, 6),
                          "step_ms_median": round(sorted(step_ms)[len(step_ms) // 2], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
