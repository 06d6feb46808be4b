#!/usr/bin/python3
"""optimus vs PyTorch: the shards' optimizer step against torch.optim itself.

What it proves: for every optimizer the shards run (adamw, adam, sgd with
momentum, lion) and six scenarios (a warmup + cosine LambdaLR schedule, two
parameter groups, clip_grad_norm_, GradScaler's skip-and-rescale rule, frozen
and gradient-less tensors, and a start from a torch optimizer state_dict), a
real job (W=3 workers, 3 shards, 50 steps, tensors of 1, 17, 37x91 and 91
elements, chunks of 4096 bytes so the big tensor spans several) ends with the
fp32 master weights and moments of torch.optim.{AdamW,Adam,SGD} (single-
tensor kernels, foreach=False; Lion as lion-pytorch writes it) given the same
averaged gradients, to 1e-6 relative (floored: see Tolerances below, torch
fuses multiply-adds that the shard rounds twice); publishes the same bf16
parameters (to one bf16 ulp); reports clip_grad_norm_'s norm (to 1e-5) and
GradScaler's found_inf/skip (exactly) for every step; counts optimizer steps
per tensor exactly as torch's state 'step' does; and exports a checkpoint
that optimizer.load_state_dict takes and that steps on like torch's own.

Each (optimizer, scenario) pair is one test case, e.g. `adamw.cosine_schedule`:
this script writes a case folder (tests/torch_compare/FORMAT.md is the file
contract), runs `DRIVER --case=DIR --out=DIR2`, and compares DIR2 with its
reference. With XML_OUTPUT_FILE set (Bazel sets it) it writes a JUnit XML with
one <testcase> per case; it prints "N passed, N failed" last and exits
non-zero on any failure.

By hand (Debian's python3 with python3-torch):
    /usr/bin/python3 tests/torch_compare/compare_test.py --driver=bazel-bin/tests/torch_compare/driver
    /usr/bin/python3 tests/torch_compare/compare_test.py \
        --driver=tests/torch_compare/fake_driver.py --only='adamw.*' --keep --workdir=/tmp/tc
(or OPTIMUS_DRIVER=PATH instead of --driver). fake_driver.py is a pure-Python
development aid that checks this script's own machinery; a run against it
proves nothing about the C++ shards.
"""

import argparse
import copy
import fnmatch
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
import xml.etree.ElementTree as ET
import zlib

import numpy as np
import torch

torch.set_num_threads(1)  # reductions (clip_grad_norm_'s norms) fixed, and fast on 2 cores

# ---------------------------------------------------------------------------
# The cases.

WORLD_SIZE = 3
SHARDS = 3
STEPS = 50
MAX_CHUNK_BYTES = 4096  # 1024 fp32 values: the 37x91 tensor spans several chunks
# (name, shape, gradient magnitude relative to the step's, init std)
TENSORS = [("scalar", [1], 3.0, 0.5),
           ("w", [37, 91], 1.0, 0.5),
           ("v17", [17], 2.0, 0.5),
           ("b", [91], 0.5, 0.01)]
T_SCALAR, T_W, T_V17, T_B = range(4)

OPTIMIZERS = {
    # lr is the peak lr of the schedule (before lr_mult).
    "adamw": dict(kind="adamw", lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.01, momentum=0.0),
    "adam": dict(kind="adam", lr=2e-3, beta1=0.85, beta2=0.995, eps=1e-6,
                 weight_decay=0.01, momentum=0.0),
    "sgd": dict(kind="sgd", lr=0.05, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=1e-3, momentum=0.9),
    "lion": dict(kind="lion", lr=1e-4, beta1=0.9, beta2=0.99, eps=1e-8,
                 weight_decay=0.1, momentum=0.0),
}

SCENARIOS = ["cosine_schedule", "param_groups", "clip_grad_norm",
             "grad_scaler_skip", "frozen_and_no_grad", "resume_from_torch_state"]

RESUME_PRE_STEPS = 7     # (f): reference steps taken before init_state.pt is written
WARMUP_STEPS = 10
GROWTH_INTERVAL = 5      # GradScaler(growth_interval=5): the scale grows in the run too
INIT_SCALE = 2.0 ** 16

# Tolerances.
#
# State (fp32 master weights and moments, final.pt and the one step after
# loading it): elementwise |got - want| <= 1e-6 * max(|want|, floor), where
# floor, per tensor and array, is the largest root-mean-square over the
# tensor that this array had at any step of torch's run (and at least its
# final rms). Why not plain relative: the shard does not round like torch.
# torch 1.13's CPU kernels fuse `exp_avg.mul_(b1).add_(g, alpha=1-b1)`,
# `addcmul_` and `param.add_(d_p, alpha=-lr)` into FMAs (measured here: 24%
# of exp_avg values of one AdamW step differ by an ulp from separately
# rounded arithmetic, 0% from an FMA); the shard rounds every multiply and
# add, multiplies by 1/sqrt(1-b2^t) where torch divides, and its global
# norm (so its clip coefficient) is summed in another order. Each such ulp
# is an ulp of the *terms* of the recurrence x = a*x + b*u, so an element
# that has decayed or cancelled to near zero carries an absolute difference
# of a few ulps of the magnitudes the array had, not of its own value (one
# 1-element exp_avg here ends at 1.5e-5 from terms of 1.5e-2). The array's
# historical rms is that magnitude; 1e-6 of it is 8 to 16 fp32 ulps.
# Margin: fake_driver.py, which rounds like the C++ scalar kernel and folds
# the clip coefficient like the shard, lands at 2.3e-7..7.4e-7 over the 24
# cases (the worst on Lion's and AdamW's exp_avg under clipping: the ulps
# accumulate over 50 steps of a beta 0.9-0.99 recurrence), while a wrong
# bias correction, lr, weight decay, step count or skipped step moves
# typical elements by 1e-5 and more.
# Worst errors are printed per case, also as plain |got - want| / |want|.
RTOL_STATE = 1e-6
# grad_norm: relative 1e-5 against clip_grad_norm_'s return value (torch sums
# the squares in fp32; any ordering lands within ~1e-6). Non-finite where
# torch's is (on skipped steps), null allowed only without clipping.
RTOL_NORM = 1e-5
# published.bin: within one bf16 ulp of torch's final params cast to bf16
# (masters that differ in the last fp32 bits may round to neighbouring bf16
# values), and exactly bf16(final.pt's master) (the shard's own consistency).
BF16_ULPS = 1


def f32(x):
    """The fp32 value of x, as a Python float (exact)."""
    return float(np.float32(x))


def seed_of(name):
    return zlib.crc32(name.encode()) & 0x7fffffff


class TensorSpec:
    def __init__(self, index, name, shape, group, frozen, offset):
        self.index, self.name, self.shape = index, name, list(shape)
        self.group, self.frozen, self.offset = group, frozen, offset
        self.numel = int(np.prod(shape))


class Case:
    """One (optimizer, scenario): its inputs and torch's results."""

    def __init__(self, opt_name, scenario):
        self.opt_name, self.scenario = opt_name, scenario
        self.name = f"{opt_name}_{scenario}"          # job name
        self.test_name = f"{opt_name}.{scenario}"     # JUnit testcase name
        o = OPTIMIZERS[opt_name]
        self.kind = o["kind"]
        # Every number the shard keeps as fp32 is written fp32-exact.
        self.hyper = {k: (f32(v) if k != "kind" else v) for k, v in o.items()}
        self.param_groups = []      # case.json's (may be empty)
        self.tensors = []
        self.steps = STEPS
        self.max_grad_norm = 0.0
        self.skip_nonfinite = True
        self.grad_dtype = "fp32"
        self.lr = []
        self.grad_mult = []
        self.no_grad = set()        # (step 1-based, rank, tensor)
        self.init = None            # flat fp32 init values
        self.grads = None           # [steps, W, total] fp32
        self.init_state = None      # torch-optim layout dict (scenario f)
        self.start_step = 1         # job step of the case's step 1
        self.injected = {}          # step -> what was injected (for messages)
        # (tensor index, "master" or a state name) -> the largest rms over
        # the tensor that array had in the reference run: the magnitude
        # floor of the state comparison (see Checker.close).
        self.scales = {}
        # Expected (torch):
        self.exp_norm, self.exp_found_inf, self.exp_skipped = [], [], []
        self.exp_counts = None
        self.ref_params = None
        self.ref_opt = None
        self.ref_layout = None
        self.extra_step_grads = None

    @property
    def total(self):
        return sum(t.numel for t in self.tensors)

    def effective_groups(self):
        """[(name, weight_decay, lr_mult, beta1, beta2, momentum)] as the shard sees them."""
        h = self.hyper
        specs = self.param_groups or [{"name": ""}]
        out = []
        for g in specs:
            out.append(dict(name=g.get("name", ""),
                            weight_decay=f32(g.get("weight_decay", h["weight_decay"])),
                            lr_mult=f32(g.get("lr_mult", 1.0)),
                            beta1=f32(g.get("beta1", h["beta1"])),
                            beta2=f32(g.get("beta2", h["beta2"])),
                            momentum=f32(g.get("momentum", h["momentum"]))))
        return out

    def group_members(self):
        return [[t.index for t in self.tensors if t.group == gi]
                for gi in range(len(self.effective_groups()))]


# --- the reference: torch.optim + a Lion written as lion-pytorch -------------

class Lion(torch.optim.Optimizer):
    """Lion as lion-pytorch (lucidrains) implements it; torch has no Lion.

    Its update_fn, in fp32 torch ops:
        p.data.mul_(1 - lr * wd)
        update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
        p.add_(update, alpha=-lr)
        exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
    State 'exp_avg', plus 'step' (lion-pytorch keeps none) so that the export
    layout is the same for every optimizer. A parameter whose .grad is None
    is skipped, as torch.optim does.
    """

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                state["step"] += 1
                p.data.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def make_params(case, flat_values):
    params = []
    for t in case.tensors:
        v = torch.from_numpy(np.array(flat_values[t.offset:t.offset + t.numel],
                                      dtype=np.float32)).reshape(t.shape).clone()
        params.append(torch.nn.Parameter(v, requires_grad=not t.frozen))
    return params


def make_optimizer(case, params):
    """The torch optimizer for the case: one param group per effective group,
    members in tensor order (so torch's state_dict ids map back to tensor
    indices), hyperparameters fp32-exact as the shard holds them."""
    h = case.hyper
    groups = []
    for gi, (g, members) in enumerate(zip(case.effective_groups(), case.group_members())):
        d = {"params": [params[i] for i in members], "lr": h["lr"],
             "weight_decay": g["weight_decay"], "name": g["name"]}
        if case.kind in ("adamw", "adam", "lion"):
            d["betas"] = (g["beta1"], g["beta2"])
        if case.kind in ("adamw", "adam"):
            d["eps"] = h["eps"]
        if case.kind == "sgd":
            d["momentum"] = g["momentum"]
        groups.append(d)
    if case.kind == "adamw":
        return torch.optim.AdamW(groups, lr=h["lr"], foreach=False)
    if case.kind == "adam":
        return torch.optim.Adam(groups, lr=h["lr"], foreach=False)
    if case.kind == "sgd":
        return torch.optim.SGD(groups, lr=h["lr"], foreach=False)
    return Lion(groups, lr=h["lr"])


def lr_lambda_for(case):
    if case.scenario in ("cosine_schedule", "resume_from_torch_state"):
        total = case.steps + (RESUME_PRE_STEPS if case.scenario == "resume_from_torch_state" else 0)

        def warmup_cosine(epoch):  # epoch 0 is the first step
            if epoch < WARMUP_STEPS:
                return (epoch + 1) / WARMUP_STEPS
            progress = (epoch - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
        return warmup_cosine
    return lambda epoch: 1.0


def attach_scheduler(case, opt, last_epoch=-1):
    """A real LambdaLR on the reference optimizer. Every group's base lr is
    the job's lr (lr_mult is applied per step, in fp32, as the shard does),
    so get_last_lr()[0] is the lr the trainer pushes for the next step."""
    for g in opt.param_groups:
        g["initial_lr"] = case.hyper["lr"]
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_for(case), last_epoch=last_epoch)


INV_W = torch.tensor(1.0 / WORLD_SIZE, dtype=torch.float32)


def reference_step(case, params, opt, counts, worker_grads, missing, lr, grad_mult):
    """One trainer step as torch does it.

    worker_grads[r][t]: fp32 tensors (the wire values, loss scale included);
    missing: set of (rank, tensor) that pushed nothing. Returns
    (norm, found_inf, skipped)."""
    gm = torch.tensor(grad_mult, dtype=torch.float32)
    for t, p in zip(case.tensors, params):
        p.grad = None
        if t.frozen:
            continue
        ranks = [r for r in range(WORLD_SIZE) if (r, t.index) not in missing]
        if not ranks:
            continue  # no rank has a gradient: .grad stays None, torch skips it
        acc = worker_grads[ranks[0]][t.index].clone()
        for r in ranks[1:]:
            acc = acc + worker_grads[r][t.index]   # rank order, fp32
        # The average (a missing rank contributes 0, the divisor stays W),
        # then GradScaler.unscale_'s multiply by inv_scale.
        p.grad = (acc * INV_W) * gm
    with_grad = [p for p in params if p.grad is not None]
    found_inf = any(not bool(torch.isfinite(p.grad).all()) for p in with_grad)
    # clip_grad_norm_ over the parameters that have a .grad; with no clipping
    # the same call with max_norm=inf returns the norm and multiplies by 1.0.
    max_norm = case.max_grad_norm if case.max_grad_norm > 0 else math.inf
    norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    skipped = found_inf and case.skip_nonfinite
    if not skipped:
        for g, eg in zip(opt.param_groups, case.effective_groups()):
            g["lr"] = f32(np.float32(lr) * np.float32(eg["lr_mult"]))
        opt.step()
        for t, p in zip(case.tensors, params):
            if p.grad is not None:
                counts[t.index] += 1
    for p in params:
        p.grad = None
    return norm, found_inf, skipped


def track_scales(case, params, opt):
    """Records each state array's rms over its tensor (running max)."""
    for t, p in zip(case.tensors, params):
        arrays = {"master": p.detach()}
        arrays.update({k: v for k, v in opt.state.get(p, {}).items()
                       if torch.is_tensor(v) and v.dim() > 0})
        for key, v in arrays.items():
            rms = float(v.double().pow(2).mean().sqrt())
            if math.isfinite(rms):
                case.scales[(t.index, key)] = max(case.scales.get((t.index, key), 0.0), rms)


def grad_scaler_update(scale, growth_tracker, found_inf, growth_factor=2.0,
                       backoff_factor=0.5, growth_interval=GROWTH_INTERVAL):
    """torch's _amp_update_scale_ (GradScaler.update), on fp32 values."""
    scale = np.float32(scale)
    if found_inf:
        return np.float32(scale * np.float32(backoff_factor)), 0
    successful = growth_tracker + 1
    if successful == growth_interval:
        new_scale = np.float32(scale * np.float32(growth_factor))
        if np.isfinite(new_scale):
            scale = new_scale
        return scale, 0
    return scale, successful


def layout_from_torch(case, params, opt, counts, resume_step, last_lr):
    """The torch-optim layout (FORMAT.md) of a torch model + optimizer: state
    ids are tensor indices, groups list them in tensor order, every stepped
    tensor's state has 'step', each group's lr is that of the last applied
    step times its lr_mult (in fp32)."""
    sd = opt.state_dict()
    packing = [i for members in case.group_members() for i in members]
    state = {}
    for pid, s in sd["state"].items():
        ti = packing[pid]
        e = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        if "step" not in e:  # torch's SGD keeps none
            e["step"] = torch.tensor(float(counts[ti]))
        state[ti] = e
    groups = []
    for g, eg, members in zip(sd["param_groups"], case.effective_groups(), case.group_members()):
        d = {"params": list(members),
             "lr": f32(np.float32(last_lr) * np.float32(eg["lr_mult"])),
             "weight_decay": float(g["weight_decay"]), "name": eg["name"]}
        if case.kind in ("adamw", "adam"):
            d.update(betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                     amsgrad=False, maximize=False)
        elif case.kind == "lion":
            d["betas"] = tuple(float(b) for b in g["betas"])
        else:
            d.update(momentum=float(g["momentum"]), dampening=0.0, nesterov=False,
                     maximize=False)
        groups.append(d)
    return {"model": {t.name: p.detach().clone() for t, p in zip(case.tensors, params)},
            "optimizer": {"state": state, "param_groups": groups},
            "job_name": case.name, "resume_step": int(resume_step)}


def load_layout(case, layout):
    """Fresh params + optimizer from a torch-optim layout through
    optimizer.load_state_dict. Raises (with a message) when it does not load
    or does not attach its state to the right tensors."""
    model = layout["model"]
    flat = np.zeros(case.total, dtype=np.float32)
    for t in case.tensors:
        v = model[t.name]
        if tuple(v.shape) != tuple(t.shape) or v.dtype != torch.float32:
            raise AssertionError(f"model[{t.name!r}]: {v.dtype} {tuple(v.shape)}, "
                                 f"want float32 {tuple(t.shape)}")
        flat[t.offset:t.offset + t.numel] = v.reshape(-1).numpy()
    params = make_params(case, flat)
    opt = make_optimizer(case, params)
    opt.load_state_dict(layout["optimizer"])
    # load_state_dict keeps state under ids its groups don't name without a
    # word: check every entry landed on a parameter.
    stray = [k for k in opt.state.keys() if not torch.is_tensor(k)]
    if stray:
        raise AssertionError(f"optimizer state ids {stray} name no parameter of the "
                             f"param_groups (ids must be tensor indices listed in a group)")
    return params, opt


# --- case generation (and the reference run alongside) -----------------------

def build_case(opt_name, scenario):
    case = Case(opt_name, scenario)
    gen = torch.Generator()
    gen.manual_seed(seed_of(case.name))
    torch.manual_seed(seed_of(case.name))

    groups_of = [0, 0, 0, 0]
    frozen = [False] * 4
    if scenario in ("param_groups", "resume_from_torch_state"):
        g1 = {"name": "no_decay", "weight_decay": 0.0, "lr_mult": f32(0.3)}
        if case.kind == "sgd":
            g1["momentum"] = f32(0.8)
        else:
            g1["beta2"] = f32(0.99 if case.kind != "lion" else 0.95)
        case.param_groups = [{"name": "decay", "weight_decay": f32(0.1), "lr_mult": 1.0}, g1]
        groups_of = [1, 0, 0, 1]   # interleaved: scalar and b decay-free
    if scenario == "param_groups":
        case.grad_dtype = "bf16"
    if scenario == "frozen_and_no_grad":
        frozen[T_V17] = True
    if scenario in ("clip_grad_norm", "grad_scaler_skip", "frozen_and_no_grad",
                    "resume_from_torch_state"):
        case.max_grad_norm = 1.0

    offset = 0
    for i, (name, shape, _, _) in enumerate(TENSORS):
        case.tensors.append(TensorSpec(i, name, shape, groups_of[i], frozen[i], offset))
        offset += case.tensors[-1].numel
    init_parts = [torch.randn(t.numel, generator=gen) * TENSORS[t.index][3] for t in case.tensors]
    case.init = torch.cat(init_parts).numpy().astype(np.float32)

    # Step magnitudes: the averaged gradient's norm is ~60 * mag. With
    # clipping, most steps are well above max_norm 1 and every 6th well below.
    def step_mag(s):
        if case.max_grad_norm > 0:
            return 0.004 if s % 6 == 3 else 0.15
        return 0.05

    def worker_grads_for(s, gen):
        """W lists of per-tensor fp32 gradients (true values, before the loss scale)."""
        mag = step_mag(s)
        out = [[None] * len(case.tensors) for _ in range(WORLD_SIZE)]
        for t in case.tensors:
            tm = mag * TENSORS[t.index][2]
            shared = torch.randn(t.shape, generator=gen)
            for r in range(WORLD_SIZE):
                g = tm * (shared + 0.7 * torch.randn(t.shape, generator=gen))
                if case.grad_dtype == "bf16":
                    g = g.to(torch.bfloat16).to(torch.float32)
                out[r][t.index] = g.to(torch.float32)
        return out

    params = make_params(case, case.init)
    opt = make_optimizer(case, params)
    sched = attach_scheduler(case, opt)
    counts = [0] * len(case.tensors)
    track_scales(case, params, opt)

    if scenario == "resume_from_torch_state":
        # k reference steps first: 'scalar' has no gradient in any of them
        # (no state entry), 'b' none at step 3 (a smaller 'step').
        pre_gen = torch.Generator()
        pre_gen.manual_seed(seed_of(case.name + "/pre"))
        pre_lr = 0.0
        for s in range(1, RESUME_PRE_STEPS + 1):
            wg = worker_grads_for(s, pre_gen)
            missing = {(r, T_SCALAR) for r in range(WORLD_SIZE)}
            if s == 3:
                missing |= {(r, T_B) for r in range(WORLD_SIZE)}
            lr = f32(sched.get_last_lr()[0])
            if not reference_step(case, params, opt, counts, wg, missing, lr, 1.0)[2]:
                pre_lr = lr
            sched.step()
            track_scales(case, params, opt)
        case.start_step = RESUME_PRE_STEPS + 1
        case.init_state = layout_from_torch(case, params, opt, counts, case.start_step, pre_lr)
        # The reference goes on from the file's content, loaded the torch way.
        params, opt = load_layout(case, copy.deepcopy(case.init_state))
        sched = attach_scheduler(case, opt, last_epoch=RESUME_PRE_STEPS - 1)
        counts = [int(case.init_state["optimizer"]["state"][i]["step"])
                  if i in case.init_state["optimizer"]["state"] else 0
                  for i in range(len(case.tensors))]
        case.init = np.concatenate([case.init_state["model"][t.name].reshape(-1).numpy()
                                    for t in case.tensors]).astype(np.float32)

    # Which (step, rank, tensor) push nothing.
    if scenario == "frozen_and_no_grad":
        for s in (1, 2):                       # scalar's first step comes late
            case.no_grad |= {(s, r, T_SCALAR) for r in range(WORLD_SIZE)}
        for s in (5, 6, 20, 50):               # b: none on every rank
            case.no_grad |= {(s, r, T_B) for r in range(WORLD_SIZE)}
        for s, r in ((10, 1), (11, 0), (25, 2), (26, 1)):   # w: none on one rank
            case.no_grad.add((s, r, T_W))
        case.no_grad.add((26, 0, T_SCALAR))
    if scenario == "resume_from_torch_state":
        case.no_grad |= {(4, r, T_B) for r in range(WORLD_SIZE)}
        case.no_grad.add((9, 2, T_W))

    scale, tracker = np.float32(INIT_SCALE), 0
    use_scaler = scenario == "grad_scaler_skip"
    grads = np.zeros((case.steps, WORLD_SIZE, case.total), dtype=np.float32)
    for s in range(1, case.steps + 1):
        wg = worker_grads_for(s, gen)
        grad_mult = 1.0
        if use_scaler:
            # The worker's backward gave grads times the scale (a power of
            # two: exact); GradScaler.unscale_ multiplies by 1/scale.
            wg = [[g * torch.tensor(float(scale), dtype=torch.float32) for g in row] for row in wg]
            grad_mult = f32(np.float32(1.0) / scale)
            if s == 4:   # one inf on one worker
                wg[1][T_W].view(-1)[100] = math.inf
                case.injected[s] = "+inf in rank 1's w[100]"
            elif s == 13:
                wg[0][T_V17][3] = math.nan
                case.injected[s] = "nan in rank 0's v17[3]"
            elif s == 14:  # +inf and -inf: the average is nan
                wg[0][T_B][7] = math.inf
                wg[2][T_B][7] = -math.inf
                case.injected[s] = "+inf (rank 0) and -inf (rank 2) in b[7]"
            elif s == 30:  # every push finite, their fp32 sum overflows
                wg[0][T_SCALAR][0] = 2.5e38
                wg[1][T_SCALAR][0] = 2.5e38
                case.injected[s] = "2.5e38 in ranks 0 and 1's scalar: the sum overflows"
        missing = {(r, t) for (ss, r, t) in case.no_grad if ss == s}
        lr = f32(sched.get_last_lr()[0])
        norm, found_inf, skipped = reference_step(case, params, opt, counts, wg, missing,
                                                  lr, grad_mult)
        sched.step()
        track_scales(case, params, opt)
        if use_scaler:
            scale, tracker = grad_scaler_update(scale, tracker, found_inf)
        case.lr.append(lr)
        case.grad_mult.append(grad_mult)
        case.exp_norm.append(norm)
        case.exp_found_inf.append(found_inf)
        case.exp_skipped.append(skipped)
        for r in range(WORLD_SIZE):
            for t in case.tensors:
                if t.frozen or (s, r, t.index) in case.no_grad:
                    # Present but ignored: NaN, so a driver that pushes it fails.
                    grads[s - 1, r, t.offset:t.offset + t.numel] = np.nan
                else:
                    grads[s - 1, r, t.offset:t.offset + t.numel] = \
                        wg[r][t.index].reshape(-1).numpy()

    case.grads = grads
    case.exp_counts = counts
    applied = [i for i in range(case.steps) if not case.exp_skipped[i]]
    case.last_applied_lr = case.lr[applied[-1]] if applied else 0.0
    case.ref_params, case.ref_opt = params, opt
    case.ref_layout = layout_from_torch(case, params, opt, counts, case.start_step + case.steps,
                                        case.last_applied_lr)
    self_check(case)
    return case


def self_check(case):
    """The scenario exercises what it claims (a generator bug is an error)."""
    n = case.steps
    if case.max_grad_norm > 0:
        clipped = sum(1 for x, f in zip(case.exp_norm, case.exp_found_inf)
                      if not f and x > case.max_grad_norm * 1.01)
        unclipped = sum(1 for x in case.exp_norm if x < case.max_grad_norm * 0.99)
        assert clipped > n // 2 and unclipped >= 3, (case.name, clipped, unclipped)
    if case.scenario == "grad_scaler_skip":
        assert sum(case.exp_skipped) == 4, case.exp_skipped
        assert len(set(case.grad_mult)) >= 3, "the scale should both back off and grow"
    else:
        assert not any(case.exp_found_inf), case.name
    assert not case.exp_skipped[-1]
    if case.scenario == "frozen_and_no_grad":
        assert case.exp_counts[T_V17] == 0 and case.exp_counts[T_B] == n - 4
        assert case.exp_counts[T_SCALAR] == n - 2
    if case.scenario == "cosine_schedule":
        assert len(set(case.lr)) > 20


# --- case folder ---------------------------------------------------------------

def write_case(case, case_dir):
    os.makedirs(case_dir, exist_ok=True)
    h = case.hyper
    doc = {
        "name": case.name,
        "world_size": WORLD_SIZE, "shards": SHARDS, "steps": case.steps,
        "max_chunk_bytes": MAX_CHUNK_BYTES,
        "optimizer": {k: h[k] for k in ("kind", "lr", "beta1", "beta2", "eps",
                                        "weight_decay", "momentum")},
        "param_groups": case.param_groups,
        "max_grad_norm": case.max_grad_norm,
        "skip_nonfinite": case.skip_nonfinite,
        "grad_dtype": case.grad_dtype,
        "param_dtype": "bf16",
        "tensors": [{"name": t.name, "shape": t.shape, "group": t.group,
                     "frozen": t.frozen} for t in case.tensors],
        "lr": case.lr,
        "grad_mult": case.grad_mult,
        "no_grad": sorted([list(x) for x in case.no_grad]),
        "init_state": case.init_state is not None,
    }
    with open(os.path.join(case_dir, "case.json"), "w") as f:
        json.dump(doc, f, indent=1)
    case.init.astype("<f4").tofile(os.path.join(case_dir, "init.bin"))
    case.grads.astype("<f4").tofile(os.path.join(case_dir, "grads.bin"))
    if case.init_state is not None:
        torch.save(case.init_state, os.path.join(case_dir, "init_state.pt"))


def driver_command(driver, case_dir, out_dir):
    cmd = [driver, f"--case={case_dir}", f"--out={out_dir}"]
    if driver.endswith(".py"):
        cmd.insert(0, sys.executable)
    return cmd


# --- comparison ----------------------------------------------------------------

def as_np(x):
    if torch.is_tensor(x):
        return x.detach().to(torch.float64).reshape(-1).numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


class Checker:
    """Collects failures and the worst errors of one case."""

    def __init__(self):
        self.failures = []
        self.notes = []
        self.worst_state = (0.0, "")      # (scaled error, where)
        self.worst_plain_rel = (0.0, "")  # |got - want| / |want|, want != 0

    def fail(self, msg):
        self.failures.append(msg)

    def close(self, what, got, want, scale=0.0, rtol=RTOL_STATE):
        """Elementwise |got - want| <= rtol * max(|want|, floor), floor =
        max(scale, rms of want over the tensor): the tolerance notes at
        RTOL_STATE say why. Non-finite values must match exactly."""
        got, want = as_np(got), as_np(want)
        if got.shape != want.shape:
            self.fail(f"{what}: {got.size} values, want {want.size}")
            return
        fin = np.isfinite(want)
        bad_nf = np.nonzero((np.isfinite(got) != fin) |
                            (~fin & (got != want) & ~(np.isnan(got) & np.isnan(want))))[0]
        if bad_nf.size:
            i = bad_nf[0]
            self.fail(f"{what}: non-finite mismatch at {bad_nf.size} elements, first [{i}]: "
                      f"got {got[i]!r} want {want[i]!r}")
            return
        if not fin.any():
            return
        w0 = np.where(fin, want, 0.0)
        floor = max(scale, float(np.sqrt(np.mean(w0[fin] ** 2))), 1e-30)
        diff = np.where(fin, np.abs(got - w0), 0.0)
        err = diff / np.maximum(np.abs(w0), floor)
        i = int(np.argmax(err))
        if err[i] > self.worst_state[0]:
            self.worst_state = (float(err[i]), f"{what}[{i}] (|want| {abs(w0[i]):.3g}, "
                                               f"floor {floor:.3g})")
        nz = fin & (np.abs(w0) > 0)
        if nz.any():
            rel = np.where(nz, diff / np.where(nz, np.abs(w0), 1.0), 0.0)
            j = int(np.argmax(rel))
            if rel[j] > self.worst_plain_rel[0]:
                self.worst_plain_rel = (float(rel[j]), f"{what}[{j}] (|want| {abs(w0[j]):.3g})")
        nbad = int((err > rtol).sum())
        if nbad:
            self.fail(f"{what}: {nbad} of {want.size} elements differ by more than {rtol:g} x "
                      f"max(|want|, floor {floor:.4g}); worst [{i}]: got {got[i]!r} want "
                      f"{want[i]!r} (|diff| {diff[i]:.3g}, scaled {err[i]:.3g})")

    def exact(self, what, got, want):
        if got != want:
            self.fail(f"{what}: got {got!r}, want {want!r}")


def bf16_key(x):
    """fp32 values -> ordered integer keys of their bf16 bits (adjacent bf16
    values differ by 1; +0 and -0 both 0)."""
    bits = (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.int64)
    mag = bits & 0x7FFF
    return np.where(bits & 0x8000, -mag, mag)


def to_bf16_f32(t):
    return t.detach().to(torch.bfloat16).to(torch.float32).reshape(-1).numpy()


def parse_norm(v):
    if v is None:
        return None
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}.get(v.lower(), v)
    return float(v)


def compare(case, out_dir, ck):
    # result.json
    try:
        with open(os.path.join(out_dir, "result.json")) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        ck.fail(f"result.json: {e}")
        return
    n = case.steps
    for key in ("grad_norm", "found_inf", "skipped", "optimizer_steps"):
        if not isinstance(res.get(key), list):
            ck.fail(f"result.json: no list '{key}'")
            return
    for key, want_len in (("grad_norm", n), ("found_inf", n), ("skipped", n),
                          ("optimizer_steps", len(case.tensors))):
        if len(res[key]) != want_len:
            ck.fail(f"result.json: '{key}' has {len(res[key])} entries, want {want_len}")
            return
    worst_norm = (0.0, 0)
    for s in range(n):
        label = f"step {s + 1}" + (f" ({case.injected[s + 1]})" if s + 1 in case.injected else "")
        ck.exact(f"found_inf at {label}", bool(res["found_inf"][s]), case.exp_found_inf[s])
        ck.exact(f"skipped at {label}", bool(res["skipped"][s]), case.exp_skipped[s])
        got, want = parse_norm(res["grad_norm"][s]), case.exp_norm[s]
        if got is None:
            if case.max_grad_norm > 0:
                ck.fail(f"grad_norm at {label}: null, want {want!r} (the job clips)")
            continue
        if isinstance(got, str):
            ck.fail(f"grad_norm at {label}: {got!r} is not a number, 'inf' or 'nan'")
            continue
        if not math.isfinite(want):
            # clip_grad_norm_ returns inf or nan here, by which non-finite
            # values met where; any non-finite report is right.
            if math.isfinite(got):
                ck.fail(f"grad_norm at {label}: {got!r}, want non-finite (torch: {want!r})")
            continue
        rel = abs(got - want) / max(abs(want), 1e-30)
        if rel > worst_norm[0]:
            worst_norm = (rel, s + 1)
        if not rel <= RTOL_NORM:
            ck.fail(f"grad_norm at {label}: {got!r}, torch's clip_grad_norm_ {want!r} "
                    f"(relative {rel:.3g} > {RTOL_NORM:g})")
    ck.notes.append(f"grad_norm worst relative error {worst_norm[0]:.3g} (step {worst_norm[1]})")
    ck.exact("optimizer_steps", [int(x) for x in res["optimizer_steps"]], case.exp_counts)
    if "resume_step" in res:
        # An imported optimizer state starts a new job: its versions count
        # from 1 (the state's own step counts live in optimizer_steps).
        ck.exact("result.json resume_step", int(res["resume_step"]), 1)

    # final.pt
    try:
        final = torch.load(os.path.join(out_dir, "final.pt"))
    except Exception as e:  # noqa: BLE001 (any unpickling error is a failure)
        ck.fail(f"final.pt does not load with torch.load: {e}")
        final = None
    if final is not None:
        compare_layout(case, final, ck)

    # published.bin
    path = os.path.join(out_dir, "published.bin")
    try:
        pub = np.fromfile(path, dtype="<f4")
    except OSError as e:
        ck.fail(f"published.bin: {e}")
        return
    if pub.size != case.total:
        ck.fail(f"published.bin: {pub.size} values, want {case.total}")
        return
    if (pub.view(np.uint32) & 0xFFFF).any():
        ck.fail("published.bin: values are not bf16 values (low 16 bits set)")
    worst_ulps = 0
    for t, p in zip(case.tensors, case.ref_params):
        got = pub[t.offset:t.offset + t.numel]
        want = to_bf16_f32(p)
        if t.frozen and not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            ck.fail(f"published {t.name}: frozen tensor changed from bf16(init)")
        ulps = np.abs(bf16_key(got) - bf16_key(want))
        i = int(np.argmax(ulps))
        worst_ulps = max(worst_ulps, int(ulps[i]))
        if ulps[i] > BF16_ULPS:
            ck.fail(f"published {t.name}: {int((ulps > BF16_ULPS).sum())} of {t.numel} values "
                    f"more than {BF16_ULPS} bf16 ulp from torch's; worst [{i}]: got {got[i]!r} "
                    f"want {want[i]!r} ({int(ulps[i])} ulps)")
        if final is not None and isinstance(final.get("model"), dict) and t.name in final["model"]:
            own = to_bf16_f32(final["model"][t.name].to(torch.float32))
            if own.size == got.size and \
                    not np.array_equal(own.view(np.uint32), got.view(np.uint32)):
                k = int(np.argmax(own.view(np.uint32) != got.view(np.uint32)))
                ck.fail(f"published {t.name}[{k}] = {got[k]!r} is not bf16(final.pt master) = "
                        f"{own[k]!r}")
    ck.notes.append(f"published worst {worst_ulps} bf16 ulp")


STATE_NAMES = {"adamw": ["exp_avg", "exp_avg_sq"], "adam": ["exp_avg", "exp_avg_sq"],
               "sgd": ["momentum_buffer"], "lion": ["exp_avg"]}


def compare_layout(case, final, ck):
    if not isinstance(final, dict) or not isinstance(final.get("model"), dict) or \
            not isinstance(final.get("optimizer"), dict):
        ck.fail("final.pt: not a dict with 'model' and 'optimizer' (torch-optim layout)")
        return
    ck.exact("final.pt job_name", final.get("job_name"), case.name)
    ck.exact("final.pt resume_step", final.get("resume_step"), 1 + case.steps)
    model = final["model"]
    ck.exact("final.pt model names", sorted(model.keys()), sorted(t.name for t in case.tensors))
    for t, p in zip(case.tensors, case.ref_params):
        v = model.get(t.name)
        if not torch.is_tensor(v) or v.dtype != torch.float32 or list(v.shape) != t.shape:
            ck.fail(f"final.pt model[{t.name!r}]: want a float32 tensor of shape {t.shape}, got "
                    f"{type(v).__name__} {getattr(v, 'dtype', '')} {list(getattr(v, 'shape', []))}")
            continue
        if t.frozen:
            init = case.init[t.offset:t.offset + t.numel]
            if not np.array_equal(v.reshape(-1).numpy().view(np.uint32), init.view(np.uint32)):
                ck.fail(f"final.pt model[{t.name!r}]: frozen tensor changed from its init")
        ck.close(f"master {t.name}", v, p, case.scales.get((t.index, "master"), 0.0))

    opt = final["optimizer"]
    state, groups = opt.get("state"), opt.get("param_groups")
    if not isinstance(state, dict) or not isinstance(groups, list):
        ck.fail("final.pt optimizer: want 'state' (dict) and 'param_groups' (list)")
        return
    want_state = case.ref_layout["optimizer"]["state"]
    ck.exact("final.pt optimizer state ids (tensors with a step)", sorted(state.keys()),
             sorted(want_state.keys()))
    for i, ws in want_state.items():
        gs = state.get(i)
        t = case.tensors[i]
        if not isinstance(gs, dict):
            continue
        step = gs.get("step")
        if not (torch.is_tensor(step) and step.dtype == torch.float32 and step.dim() == 0):
            ck.fail(f"state[{i}] ({t.name}) 'step': want a 0-d float32 tensor, got {step!r}")
        else:
            ck.exact(f"state[{i}] ({t.name}) step", float(step), float(case.exp_counts[i]))
        for key in STATE_NAMES[case.kind]:
            v = gs.get(key)
            if not torch.is_tensor(v) or v.dtype != torch.float32 or list(v.shape) != t.shape:
                ck.fail(f"state[{i}] ({t.name}) {key!r}: want a float32 tensor of shape {t.shape}")
                continue
            ck.close(f"{key} {t.name}", v, ws[key], case.scales.get((i, key), 0.0))
    want_groups = case.ref_layout["optimizer"]["param_groups"]
    if len(groups) != len(want_groups):
        ck.fail(f"final.pt param_groups: {len(groups)}, want {len(want_groups)}")
        return
    last_lr = case.last_applied_lr
    for gi, (g, wg, eg) in enumerate(zip(groups, want_groups, case.effective_groups())):
        ck.exact(f"param_groups[{gi}] params", list(g.get("params", [])), wg["params"])
        if eg["name"] or g.get("name") not in (None, ""):   # the implicit group may have none
            ck.exact(f"param_groups[{gi}] name", g.get("name"), eg["name"])
        want_keys = {"lr": f32(np.float32(last_lr) * np.float32(eg["lr_mult"])),
                     "weight_decay": eg["weight_decay"]}
        if case.kind in ("adamw", "adam"):
            want_keys["eps"] = case.hyper["eps"]
        if case.kind == "sgd":
            want_keys.update(momentum=eg["momentum"], dampening=0.0)
        for k, want in want_keys.items():
            got = g.get(k)
            if not isinstance(got, (int, float)) or f32(got) != f32(want):
                ck.fail(f"param_groups[{gi}] {k!r}: {got!r}, want {want!r}")
        if case.kind in ("adamw", "adam", "lion"):
            b = g.get("betas")
            if not isinstance(b, (tuple, list)) or len(b) != 2 or \
                    (f32(b[0]), f32(b[1])) != (eg["beta1"], eg["beta2"]):
                ck.fail(f"param_groups[{gi}] 'betas': {b!r}, want ({eg['beta1']}, {eg['beta2']})")

    # The export loads into the torch optimizer and steps on as torch's own state does.
    if ck.failures:
        return  # the state already differs; one more step says nothing new
    try:
        params, opt = load_layout(case, final)
    except Exception as e:  # noqa: BLE001
        ck.fail(f"final.pt does not load with optimizer.load_state_dict: "
                f"{type(e).__name__}: {e}")
        return
    ref_params, ref_opt = load_layout(case, copy.deepcopy(case.ref_layout))
    for i, t in enumerate(case.tensors):
        if i in want_state:
            st = opt.state.get(params[i], {})
            for key in STATE_NAMES[case.kind] + ["step"]:
                if key not in st:
                    ck.fail(f"after load_state_dict, {t.name} has no state {key!r}")
    if ck.failures:
        return
    gen = torch.Generator()
    gen.manual_seed(seed_of(case.name + "/extra"))
    extra = [torch.randn(t.shape, generator=gen) * 0.01 for t in case.tensors]
    for ps, o in ((params, opt), (ref_params, ref_opt)):
        for t, p, g in zip(case.tensors, ps, extra):
            p.grad = None if t.frozen else g.clone()
        for g, eg in zip(o.param_groups, case.effective_groups()):
            g["lr"] = f32(np.float32(last_lr) * np.float32(eg["lr_mult"]))
        try:
            o.step()
        except Exception as e:  # noqa: BLE001
            ck.fail(f"one more optimizer.step() after loading final.pt fails: "
                    f"{type(e).__name__}: {e!r}")
            return
    for i, t in enumerate(case.tensors):
        ck.close(f"one more step from final.pt: master {t.name}", params[i], ref_params[i],
                 case.scales.get((i, "master"), 0.0))
        if t.frozen:
            continue
        for key in STATE_NAMES[case.kind]:
            ck.close(f"one more step from final.pt: {key} {t.name}",
                     opt.state[params[i]][key], ref_opt.state[ref_params[i]][key],
                     case.scales.get((i, key), 0.0))
        if case.kind != "sgd":
            ck.exact(f"one more step from final.pt: step {t.name}",
                     float(opt.state[params[i]]["step"]),
                     float(ref_opt.state[ref_params[i]]["step"]))


# --- test runner ---------------------------------------------------------------

class Config:
    driver = None
    workdir = None
    keep = False
    timeout = 600


def run_case(opt_name, scenario):
    """Builds, runs and compares one case; returns notes, raises AssertionError."""
    case = build_case(opt_name, scenario)
    root = os.path.join(Config.workdir, case.name)
    shutil.rmtree(root, ignore_errors=True)
    case_dir, out_dir = os.path.join(root, "case"), os.path.join(root, "out")
    write_case(case, case_dir)
    os.makedirs(out_dir)
    cmd = driver_command(Config.driver, case_dir, out_dir)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=Config.timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"").decode(errors="replace")[-3000:]
        raise AssertionError(f"driver timed out after {Config.timeout} s: {' '.join(cmd)}\n{tail}\n"
                             f"case kept in {root}")
    driver_s = time.monotonic() - t0
    if proc.returncode != 0:
        tail = proc.stdout.decode(errors="replace")[-3000:]
        raise AssertionError(f"driver exited {proc.returncode}: {' '.join(cmd)}\n{tail}\n"
                             f"case kept in {root}")
    ck = Checker()
    compare(case, out_dir, ck)
    notes = [f"driver {driver_s:.1f} s",
             f"worst state error {ck.worst_state[0]:.3g} of max(|want|, floor) at "
             f"{ck.worst_state[1]}",
             f"worst plain relative error {ck.worst_plain_rel[0]:.3g} at {ck.worst_plain_rel[1]}"]
    notes += ck.notes
    if ck.failures:
        shown = ck.failures[:25]
        more = len(ck.failures) - len(shown)
        raise AssertionError("\n".join(shown + ([f"... and {more} more"] if more else []) +
                                       [f"case kept in {root}", "; ".join(notes)]))
    if not Config.keep:
        shutil.rmtree(root, ignore_errors=True)
    return notes


class TorchCompareTest(unittest.TestCase):
    """One generated method per (optimizer, scenario)."""
    notes = {}


def _make_test(opt_name, scenario):
    def test(self):
        TorchCompareTest.notes[f"{opt_name}.{scenario}"] = run_case(opt_name, scenario)
    test.__doc__ = f"{opt_name}.{scenario}"
    return test


ALL_CASES = [(o, s) for o in OPTIMIZERS for s in SCENARIOS]
for _o, _s in ALL_CASES:
    setattr(TorchCompareTest, f"test_{_o}__{_s}", _make_test(_o, _s))


class RecordingResult(unittest.TestResult):
    """Keeps (name, outcome, seconds, message) per test, prints as it goes."""

    def __init__(self):
        super().__init__()
        self.records = []
        self._t0 = 0.0

    @staticmethod
    def case_name(test):
        return test.shortDescription() or test.id()

    def startTest(self, test):
        super().startTest(test)
        self._t0 = time.monotonic()

    def _record(self, test, outcome, msg=""):
        secs = time.monotonic() - self._t0
        name = self.case_name(test)
        self.records.append((name, outcome, secs, msg))
        notes = TorchCompareTest.notes.get(name, [])
        print(f"[{outcome:>6}] {name} ({secs:.1f} s)" + (f": {'; '.join(notes)}" if notes else ""),
              flush=True)
        if msg:
            print("    " + msg.replace("\n", "\n    "), flush=True)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "PASS")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "FAIL", str(err[1]))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "ERROR", "".join(traceback.format_exception(*err))[-4000:])


def write_junit(path, records, total_s):
    failures = sum(1 for r in records if r[1] == "FAIL")
    errors = sum(1 for r in records if r[1] == "ERROR")
    suites = ET.Element("testsuites")
    suite = ET.SubElement(suites, "testsuite", name="torch_compare", tests=str(len(records)),
                          failures=str(failures), errors=str(errors), time=f"{total_s:.3f}")
    for name, outcome, secs, msg in records:
        tc = ET.SubElement(suite, "testcase", name=name, classname="torch_compare",
                           time=f"{secs:.3f}")
        if outcome in ("FAIL", "ERROR"):
            el = ET.SubElement(tc, "failure" if outcome == "FAIL" else "error",
                               message=msg.splitlines()[0][:500] if msg else outcome)
            el.text = msg
        notes = TorchCompareTest.notes.get(name)
        if notes:
            ET.SubElement(tc, "system-out").text = "\n".join(notes)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ET.ElementTree(suites).write(path, encoding="UTF-8", xml_declaration=True)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--driver", default=os.environ.get("OPTIMUS_DRIVER"),
                    help="the driver binary (or fake_driver.py); default $OPTIMUS_DRIVER")
    ap.add_argument("--only", action="append", default=[],
                    help="glob over case names like 'adamw.*' (repeatable)")
    ap.add_argument("--workdir", default=None,
                    help="where case folders go (default $TEST_TMPDIR or a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep passing cases' folders too")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per driver run")
    ap.add_argument("--list", action="store_true", help="list the case names and exit")
    args = ap.parse_args(argv)
    names = [f"{o}.{s}" for o, s in ALL_CASES]
    selected = [n for n in names if not args.only or any(fnmatch.fnmatch(n, p) for p in args.only)]
    if args.list:
        print("\n".join(selected))
        return 0
    if not args.driver:
        print("compare_test.py: no driver: pass --driver=PATH or set OPTIMUS_DRIVER",
              file=sys.stderr)
        return 2
    if not selected:
        print(f"compare_test.py: --only {args.only} matches no case", file=sys.stderr)
        return 2
    Config.driver = os.path.abspath(args.driver)
    if not os.path.exists(Config.driver):
        print(f"compare_test.py: driver {Config.driver} does not exist", file=sys.stderr)
        return 2
    Config.keep, Config.timeout = args.keep, args.timeout
    made_workdir = not (args.workdir or os.environ.get("TEST_TMPDIR"))
    Config.workdir = args.workdir or os.environ.get("TEST_TMPDIR") or \
        tempfile.mkdtemp(prefix="torch_compare_")
    Config.workdir = os.path.abspath(Config.workdir)
    os.makedirs(Config.workdir, exist_ok=True)
    print(f"torch {torch.__version__}, driver {Config.driver}, cases in {Config.workdir}",
          flush=True)
    if os.path.basename(Config.driver) == "fake_driver.py":
        print("NOTE: fake_driver.py is a development aid; this run checks the suite, "
              "not the shards", flush=True)

    suite = unittest.TestSuite()
    for o, s in ALL_CASES:
        if f"{o}.{s}" in selected:
            suite.addTest(TorchCompareTest(f"test_{o}__{s}"))
    result = RecordingResult()
    t0 = time.monotonic()
    suite.run(result)
    total_s = time.monotonic() - t0
    passed = sum(1 for r in result.records if r[1] == "PASS")
    failed = len(result.records) - passed
    xml_path = os.environ.get("XML_OUTPUT_FILE")
    if xml_path:
        write_junit(xml_path, result.records, total_s)
    if made_workdir and not Config.keep and failed == 0:
        shutil.rmtree(Config.workdir, ignore_errors=True)
    print(f"torch_compare: {total_s:.1f} s")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed == len(selected) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
