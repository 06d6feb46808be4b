#!/usr/bin/python3
"""DEVELOPMENT AID ONLY: a pure-Python stand-in for the C++ driver.

It is NOT a test and proves nothing about the shards: it exists so that
compare_test.py's comparison machinery (case files, result parsing,
tolerances, the export loading into torch) can be checked end to end before
the real driver exists, and to see how far an implementation that rounds
differently from torch lands from it.

    /usr/bin/python3 tests/torch_compare/compare_test.py --driver=tests/torch_compare/fake_driver.py

It reads a case folder and writes an out folder as FORMAT.md says, with the
shard semantics written there, in numpy fp32 arithmetic that follows the C++
scalar kernel (kernels/cpu/optimizer_scalar.cc: every multiply and add rounds
separately, constants derived in double and rounded once), not torch's
kernels. Like the shard (server/steps.cc, client/client.cc), and unlike
torch, it folds the clip coefficient, computed in fp32 as
min(max_norm / (norm + 1e-6), 1), into the gradient scale (the element sum
is multiplied once by fp32(1/W) * grad_mult * coef), and sums the global
norm's squares in double per chunk.

    fake_driver.py --case=DIR --out=DIR2 [--break=WHAT]

--break=... corrupts the result on purpose (to check that the suite fails):
  master (one master value off by 1e-5 relative), norm (grad_norm off by
  1e-4), skip (found_inf ignored), steps (optimizer_steps off by one),
  export_ids (state keyed by torch's packing order instead of tensor index).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

F = np.float32


def f32(x):
    return float(np.float32(x))


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--break", dest="brk", default="")
    args = ap.parse_args(argv)
    with open(os.path.join(args.case, "case.json")) as f:
        c = json.load(f)
    W, steps = c["world_size"], c["steps"]
    opt = c["optimizer"]
    kind = opt["kind"]
    tensors = c["tensors"]
    numels = [int(np.prod(t["shape"])) for t in tensors]
    offsets = np.cumsum([0] + numels)[:-1]
    total = sum(numels)
    specs = c["param_groups"] or [{"name": ""}]
    groups = []
    for g in specs:
        groups.append(dict(name=g.get("name", ""),
                           weight_decay=f32(g.get("weight_decay", opt["weight_decay"])),
                           lr_mult=f32(g.get("lr_mult", 1.0)),
                           beta1=f32(g.get("beta1", opt["beta1"])),
                           beta2=f32(g.get("beta2", opt["beta2"])),
                           momentum=f32(g.get("momentum", opt["momentum"]))))
    eps = f32(opt["eps"])
    nmom = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1}[kind]
    names = {"adamw": ["exp_avg", "exp_avg_sq"], "adam": ["exp_avg", "exp_avg_sq"],
             "sgd": ["momentum_buffer"], "lion": ["exp_avg"]}[kind]

    master = np.fromfile(os.path.join(args.case, "init.bin"), dtype="<f4").astype(F)
    moments = [np.zeros(total, dtype=F) for _ in range(nmom)]
    counts = [0] * len(tensors)
    has_state = [False] * len(tensors)
    resume_step = 1
    if c.get("init_state"):
        st = torch.load(os.path.join(args.case, "init_state.pt"))
        resume_step = int(st["resume_step"])
        for i, t in enumerate(tensors):
            o = offsets[i]
            master[o:o + numels[i]] = st["model"][t["name"]].reshape(-1).numpy()
            s = st["optimizer"]["state"].get(i)
            if s is not None:
                has_state[i] = True
                counts[i] = int(float(s["step"]))
                for k, name in enumerate(names):
                    moments[k][o:o + numels[i]] = s[name].reshape(-1).numpy()

    grads = np.fromfile(os.path.join(args.case, "grads.bin"), dtype="<f4").reshape(steps, W, total)
    no_grad = {tuple(x) for x in c["no_grad"]}
    max_norm = float(c["max_grad_norm"])
    res = {"grad_norm": [], "found_inf": [], "skipped": [], "resume_step": resume_step}
    last_lr = 0.0
    for s in range(1, steps + 1):
        grad_scale = F(F(1.0 / W) * F(c["grad_mult"][s - 1]))
        sums = {}
        for i, t in enumerate(tensors):
            if t["frozen"]:
                continue
            ranks = [r for r in range(W) if (s, r, i) not in no_grad]
            if not ranks:
                continue
            o = offsets[i]
            acc = grads[s - 1, ranks[0], o:o + numels[i]].copy()
            for r in ranks[1:]:
                acc = acc + grads[s - 1, r, o:o + numels[i]]
            sums[i] = acc
        avg = {i: a * grad_scale for i, a in sums.items()}
        found_inf = any(not np.isfinite(a).all() for a in avg.values())
        with np.errstate(over="ignore", invalid="ignore"):
            sq = 0.0
            for a in avg.values():
                for k in range(0, a.size, 1024):     # per chunk, in double
                    sq += float(np.sum(a[k:k + 1024].astype(np.float64) ** 2))
            norm = math.sqrt(sq) if not math.isnan(sq) else math.nan
        res["grad_norm"].append(norm if math.isfinite(norm) else
                                ("nan" if math.isnan(norm) else "inf"))
        if args.brk == "norm" and s == 7:
            res["grad_norm"][-1] = norm * (1 + 1e-4)
        skip = found_inf and c["skip_nonfinite"] and args.brk != "skip"
        res["found_inf"].append(bool(found_inf) and args.brk != "skip")
        res["skipped"].append(bool(skip))
        if skip:
            continue
        coef = F(1.0)
        if max_norm > 0 and math.isfinite(norm):
            coef = min(F(max_norm) / (F(norm) + F(1e-6)), F(1.0))   # in fp32
        scale = grad_scale * coef   # (fp32(1/W) * grad_mult) * coef, one fp32 multiply each
        lr_push = F(c["lr"][s - 1])
        last_lr = float(lr_push)
        for i, acc in sums.items():
            t = tensors[i]
            gsp = groups[t["group"]]
            o, n = offsets[i], numels[i]
            sl = slice(o, o + n)
            counts[i] += 1
            has_state[i] = True
            step_kernel(kind, gsp, eps, F(lr_push * F(gsp["lr_mult"])), counts[i],
                        acc * scale, master[sl], [m[sl] for m in moments])
    if args.brk == "master":
        master[5] = F(master[5] * F(1 + 1e-5))
    res["optimizer_steps"] = [c2 + (1 if args.brk == "steps" and i == 0 else 0)
                              for i, c2 in enumerate(counts)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(res, f)
    pub = torch.from_numpy(master.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    pub.astype("<f4").tofile(os.path.join(args.out, "published.bin"))

    members = [[i for i, t in enumerate(tensors) if t["group"] == gi] for gi in range(len(groups))]
    packing = [i for m in members for i in m]
    state = {}
    for i, t in enumerate(tensors):
        if not has_state[i]:
            continue
        o, n = offsets[i], numels[i]
        e = {"step": torch.tensor(float(counts[i]))}
        for k, name in enumerate(names):
            e[name] = torch.from_numpy(moments[k][o:o + n].copy()).reshape(t["shape"])
        key = packing.index(i) if args.brk == "export_ids" else i
        state[key] = e
    pgroups = []
    for gi, g in enumerate(groups):
        d = {"params": members[gi], "lr": f32(F(last_lr) * F(g["lr_mult"])),
             "weight_decay": g["weight_decay"], "name": g["name"]}
        if kind in ("adamw", "adam", "lion"):
            d["betas"] = (g["beta1"], g["beta2"])
        if kind in ("adamw", "adam"):
            d["eps"] = eps
        if kind == "sgd":
            d.update(momentum=g["momentum"], dampening=0.0, nesterov=False)
        pgroups.append(d)
    final = {"model": {t["name"]: torch.from_numpy(master[offsets[i]:offsets[i] + numels[i]].copy())
                       .reshape(t["shape"]) for i, t in enumerate(tensors)},
             "optimizer": {"state": state, "param_groups": pgroups},
             "job_name": c["name"], "resume_step": resume_step + steps}
    torch.save(final, os.path.join(args.out, "final.pt"))
    return 0


def step_kernel(kind, g, eps, lr, t, grad, p, ms):
    """kernels/cpu/optimizer_scalar.cc's StepRangeScalar on numpy fp32 arrays
    (p and ms are views, updated in place)."""
    wd = g["weight_decay"]
    lr_d = float(lr)
    decay = F(1.0 - lr_d * float(wd))
    b1, b2 = F(g["beta1"]), F(g["beta2"])
    omb1, omb2 = F(1.0 - float(b1)), F(1.0 - float(b2))
    P = p.copy()
    G = grad.astype(F)
    with np.errstate(over="ignore", invalid="ignore"):
        if kind in ("adamw", "adam"):
            if wd != 0:
                if kind == "adamw":
                    P = P * decay
                else:
                    G = G + F(wd) * P
            bc1 = 1.0 - math.pow(float(b1), t)
            bc2 = 1.0 - math.pow(float(b2), t)
            step_size = F(lr_d / bc1)
            inv_sqrt_bc2 = F(1.0 / math.sqrt(bc2))
            m = ms[0] * b1 + omb1 * G
            v = ms[1] * b2 + (omb2 * G) * G
            denom = np.sqrt(v) * inv_sqrt_bc2 + F(eps)
            P = P - (step_size * m) / denom
            ms[0][:] = m
            ms[1][:] = v
        elif kind == "sgd":
            if wd != 0:
                G = G + F(wd) * P
            mom = F(g["momentum"])
            if mom != 0:
                m = ms[0] * mom + G
                ms[0][:] = m
                G = m
            P = P - lr * G
        else:
            if wd != 0:
                P = P * decay
            c = ms[0] * b1 + omb1 * G
            P = P - lr * np.sign(c).astype(F)
            ms[0][:] = ms[0] * b2 + omb2 * G
    p[:] = P


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
