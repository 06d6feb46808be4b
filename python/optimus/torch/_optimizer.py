"""optimus.torch.DistributedOptimizer: torch.optim's interface, the shards'
optimizer.

How a step moves (mode "layerwise", the default, exact):
  * forward: each module's forward pre-hook waits only for the pulls of its
    own direct parameters and copies them in (the first forward has them
    already);
  * backward: each parameter's gradient, once accumulated, is cast into a
    reused staging tensor of the job's grad dtype and pushed at once from
    the AccumulateGrad node's hook, without waiting;
  * step(): parameters that got no gradient are pushed as "no gradient"
    (torch skips a None grad; optimus leaves the tensor alone unless another
    rank has one), then the pulls of the next version are issued in the
    order the last forward used the parameters.
Mode "delayed" (one step stale, as DeepSpeed's delayed parameter update):
the forward of step t+1 uses the parameters after step t-1, so the shards'
step and both transfers overlap the whole next iteration. Mode "none": step()
pushes every gradient and waits, and the next forward first pulls every
parameter (the blocking behaviour; same numbers as "layerwise").

Every rank pushes, for each tensor, its group's current ``lr``
(``param_groups[i]["lr"]``, which any torch.optim.lr_scheduler sets) and
``1 / loss_scale``; the job's groups are created with lr_mult 1 and the
torch groups' weight_decay and betas.
"""

import math
import mmap
import os
import time
import warnings

import torch

import optimus
from optimus import _C

MODES = ("layerwise", "delayed", "none")

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIGN_BYTES = 64
_HUGE_PAGE_BYTES = 2 << 20


def _job_lost(e):
    """Whether a failed wait means the job failed or was replaced (deleted, or
    restored from its checkpoint after a failure): re-joining may help."""
    if isinstance(e, optimus.Unavailable):
        return True
    return isinstance(e, optimus.NotFound) and "ticket" not in str(e)


class _Tensor:
    """One job tensor: its parameter, staging views and requests in flight."""

    __slots__ = ("index", "name", "param", "group", "numel", "grad_stage", "param_stage",
                 "pull_ticket", "pull_version", "staged_version", "push_ticket", "pushed_step",
                 "hook_calls", "order", "model_version")

    def __init__(self, index, name, param, group):
        self.index = index
        self.name = name
        self.param = param
        self.group = group
        self.numel = param.numel()
        self.grad_stage = None
        self.param_stage = None
        self.pull_ticket = None     # Pull in flight into param_stage.
        self.pull_version = 0       # Its version.
        self.staged_version = 0     # A waited pull's version not yet copied into param.
        self.push_ticket = None     # The last push, not waited yet.
        self.pushed_step = 0        # The last step pushed.
        self.hook_calls = 0         # Backward passes that reached it this step.
        self.order = 1 << 30        # When the last forward used it.
        self.model_version = 0      # The version param holds.


def _huge_page_bytes(nbytes):
    """`nbytes` of zeroed memory starting on a 2 MiB boundary, as a uint8
    tensor; from 2 MiB on advised for transparent huge pages before it is
    first touched. The client sends from and receives into it: over 4 KiB
    pages every shared-memory transfer walks and pins each page
    (docs/benchmarks.md, "Huge pages")."""
    # Private: an anonymous shared mapping is shmem, which gets huge pages
    # only under shmem_enabled.
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)
    if nbytes >= _HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # No transparent huge pages in this kernel.
            pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # Keeps the mapping alive.
    shift = (-raw.data_ptr()) % _HUGE_PAGE_BYTES
    return raw.narrow(0, shift, nbytes)


def _carve(tensors, dtype, attr):
    """One arena of `dtype` for all tensors, each view starting on a 64-byte
    boundary; sets t.<attr> to each tensor's view. Returns the arena."""
    elem = torch.empty((), dtype=dtype).element_size()
    align = _ALIGN_BYTES // elem
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += (t.numel + align - 1) // align * align
    arena = _huge_page_bytes(max(total, 1) * elem).view(dtype)
    for t, off in zip(tensors, offsets):
        setattr(t, attr, arena.narrow(0, off, t.numel).view(t.param.shape))
    return arena


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step runs on the optimus shards.

    Constructed like torch.optim.AdamW (params or param groups, lr, betas,
    eps, weight_decay), plus:

    model: the nn.Module holding the parameters: names the job's tensors
        (named_parameters()) and carries the forward pre-hooks. Without it,
        tensors are named "group{g}.{i}" and step() waits for the new
        parameters before it returns.
    coordinator: optimus-coord's "host:port", or several comma-separated
        ("a:7070,b:7070": a leader and its standbys; calls follow whichever
        leads); default $OPTIMUS_COORDINATOR.
    job_name: default $OPTIMUS_JOB, the job spec's name, or "optimus-job".
    rank, world_size: default $RANK and $WORLD_SIZE (as torchrun sets them);
        with neither, the job spec's world_size, else one process.
    config: a job spec file (YAML or JSON, docs/job-spec.md; default
        $OPTIMUS_JOB_SPEC) read by the project's parser (client/job_config):
        it then decides the job (optimizer, clipping, dtypes, replication,
        checkpoints) and its param_groups, matched by name, become the torch
        groups (pass the parameters as one list); the job-setting arguments
        below are ignored with a warning; lr= still sets the base lr.
    optimizer: "adamw" (default), "adam", "sgd" (momentum=) or "lion".
    max_grad_norm: > 0: the shards clip the averaged gradient's global L2
        norm (clip_grad_norm_'s rule); the norm is ``grad_norm``.
    skip_nonfinite: skip a step whose averaged gradient holds an inf/NaN
        (GradScaler's rule); reported as ``last_step_report.found_inf``.
    grad_dtype, param_dtype: "bf16" (default), "fp16" or "fp32" on the wire.
    replication: 0 or 1 backups per chunk. checkpoint_every_steps: the
        coordinator's policy (needs --checkpoint_dir there).
    mode: "layerwise" (default), "delayed" or "none" (see the module doc).
    loss_scale: a float, or an object with get_scale() (e.g. a GradScaler):
        each step's gradients are multiplied by 1 / its value on the shards
        (GradScaler itself is disabled without CUDA: use a float there).
    backward_passes_per_step: gradient accumulation: a parameter is pushed
        when this many backward passes reached it.
    follow_rollback: when the job fails and the coordinator restores it from
        a checkpoint, re-join it inside step() or forward and go on from its
        resume step (the model's parameters are pulled from it).
    timeout_s: how long one wait may take before DeadlineExceeded.
    transports, net_devices: UCX settings (default: the environment's).

    Setup is client::JoinOrCreate: rank 0 creates the job (or joins it when
    it exists), every rank joins with retries, and the joined job must hold
    exactly these parameters (FailedPrecondition naming the first
    difference). For a new job rank 0 sends the model's values (or a state
    given to load_state_dict first) at the first forward; other ranks pull
    them. Call close() at the end: it brings the model up to date and leaves
    the job.
    """

    _step_supports_amp_scaling = True

    def __init__(self, params, lr=None, betas=None, eps=None, weight_decay=None, *,
                 model=None, coordinator=None, job_name=None, rank=None, world_size=None,
                 config=None, optimizer=None, momentum=None, max_grad_norm=None,
                 skip_nonfinite=None, grad_dtype=None, param_dtype=None, replication=None,
                 checkpoint_every_steps=None, chunk_payload_bytes=None, mode="layerwise",
                 loss_scale=None, backward_passes_per_step=1, follow_rollback=True,
                 timeout_s=300.0, join_timeout_s=120.0, transports=None, net_devices=None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if lr is not None and lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        self._model = model
        self._mode = mode
        self._loss_scale = loss_scale
        self._bpps = int(backward_passes_per_step)
        self._follow_rollback = follow_rollback
        self._timeout = float(timeout_s)
        self._join_timeout = float(join_timeout_s)
        params = list(params)
        if not params:
            raise ValueError("DistributedOptimizer got an empty parameter list")
        self._spec_world = False

        spec_path = os.fspath(config) if config is not None else \
            os.environ.get("OPTIMUS_JOB_SPEC", "")
        if spec_path:
            # The job spec file decides the job (client::JoinOrCreate applies
            # it); the torch groups mirror its groups.
            ignored = [k for k, v in dict(
                optimizer=optimizer, betas=betas, eps=eps, weight_decay=weight_decay,
                momentum=momentum, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
                grad_dtype=grad_dtype, param_dtype=param_dtype, replication=replication,
                checkpoint_every_steps=checkpoint_every_steps,
                chunk_payload_bytes=chunk_payload_bytes).items() if v is not None]
            if ignored:
                warnings.warn(f"optimus: the job spec {spec_path} sets the job's settings; "
                              f"ignoring {', '.join(ignored)}")
            job, groups, defaults = self._from_spec(spec_path, params, lr)
        else:
            kind = (optimizer or "adamw").lower()
            if kind not in self._MOMENTS:
                raise ValueError(f"optimizer must be adamw, adam, sgd or lion, got {optimizer!r}")
            defaults = dict(
                lr=1e-3 if lr is None else lr,
                betas=tuple(betas) if betas is not None else
                ((0.9, 0.99) if kind == "lion" else (0.9, 0.999)),
                eps=1e-8 if eps is None else eps,
                weight_decay=(1e-2 if kind == "adamw" else 0.0) if weight_decay is None
                else weight_decay,
                momentum=0.0 if momentum is None else momentum)
            job = _C.JobDef()
            job.optimizer = _C.OptimizerSpec()
            job.optimizer.kind = kind
            job.max_grad_norm = float(max_grad_norm or 0.0)
            job.skip_nonfinite = True if skip_nonfinite is None else bool(skip_nonfinite)
            job.grad_dtype = grad_dtype or "bf16"
            job.param_dtype = param_dtype or "bf16"
            job.replication = int(replication or 0)
            job.checkpoint_every_steps = int(checkpoint_every_steps or 0)
            job.chunk_payload_bytes = int(chunk_payload_bytes or 0)
            groups = params
        super().__init__(groups, defaults)
        self._tensors = self._map_tensors()
        self._kind = job.optimizer.kind
        self._max_grad_norm = job.max_grad_norm
        self._skip_nonfinite = job.skip_nonfinite
        self._fill_job(job, from_spec=bool(spec_path))

        self._client = None
        self._arenas = []
        self._started = False
        self._init_state = None     # {tensor index: (exp_avg, exp_avg_sq, step)} from load_state_dict
        self._step = 0              # The step being computed (pushed next).
        self._resume = 0
        self._job_id = 0
        self._reports = {}
        self._deferred = None       # An error a hook could not raise.
        self._forward_clock = 0
        self._need_pull_all = False
        self._warned_stale = False
        self._hooks = []
        if world_size is None and rank is None and not self._spec_world and \
                not os.environ.get("RANK") and not os.environ.get("WORLD_SIZE"):
            world_size = 1  # One process, as torch.optim (client::Session would refuse).
        # client::JoinOrCreate: rank 0 creates (or joins the existing job),
        # every rank joins with retries; the joined job's tensors are checked.
        self._session = _C.Session.join_or_create(
            job, coordinator=coordinator or "", rank=-1 if rank is None else int(rank),
            world_size=-1 if world_size is None else int(world_size), job_name=job_name or "",
            job_spec_path=spec_path, join_timeout_s=self._join_timeout,
            transports=transports or "", net_devices=net_devices or "",
            ready_timeout_s=self._join_timeout)
        self._coordinator = coordinator or os.environ.get("OPTIMUS_COORDINATOR", "")
        self._rank = self._session.rank
        self._world = self._session.world_size
        self._job_name = self._session.job_name
        self._adopt(self._session.client)
        self._install_hooks()
        if self._model is None and (self._rank != 0 or self._resume > 1):
            # No forward pre-hook to start from: take the job's values now
            # (rank 0 of a new job sends them at its first step).
            self._start()

    # ------------------------------------------------------------------ setup

    def _names(self):
        if self._model is None:
            return None
        return {id(p): n for n, p in self._model.named_parameters()}

    def _from_spec(self, path, params, lr):
        """The job, torch param groups and defaults from a job spec file."""
        spec = optimus.load_job_config(path)
        self._spec_world = spec.has_world_size
        if spec.has_tensors:
            preset = f" or name a preset (model: {spec.model})" if spec.model else ""
            raise ValueError(f"{path}: a trainer's job spec must not list tensors{preset} (they "
                             "come from the model)")
        if isinstance(params[0], dict):
            if len(params) > 1:
                raise ValueError(f"with a job spec ({path}), the parameter groups come from its "
                                 "param_groups: pass the parameters as one list "
                                 "(e.g. model.parameters())")
            params = list(params[0]["params"])
        names = self._names()
        if names is None and spec.group_match:
            raise ValueError(f"{path} has param_groups, matched by name: pass model=")
        job = spec.job
        if not spec.has_name:
            job.name = "optimus-job"  # $OPTIMUS_JOB or job_name= override it.
        tensors = []
        for i, p in enumerate(params):
            name = names.get(id(p)) if names is not None else f"group0.{i}"
            if name is None:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not a parameter "
                                 "of model")
            tensors.append(_C.TensorDef(name, list(p.shape), 0, not p.requires_grad))
        job.tensors = tensors
        job = optimus.assign_groups(spec, job)
        o = job.optimizer
        b1, b2 = (0.9, 0.99) if o.kind == "lion" else (0.9, 0.999)
        defaults = dict(lr=o.lr if lr is None else lr, betas=(o.beta1 or b1, o.beta2 or b2),
                        eps=o.eps or 1e-8, weight_decay=o.weight_decay, momentum=o.momentum)
        if not job.param_groups:
            return job, [{"params": params}], defaults
        groups = []
        for gi, pg in enumerate(job.param_groups):
            g = {"params": [p for p, t in zip(params, job.tensors) if t.group == gi],
                 "name": pg.name}
            if pg.weight_decay is not None:
                g["weight_decay"] = pg.weight_decay
            if pg.beta1 is not None or pg.beta2 is not None:
                g["betas"] = (pg.beta1 if pg.beta1 is not None else defaults["betas"][0],
                              pg.beta2 if pg.beta2 is not None else defaults["betas"][1])
            if pg.momentum is not None:
                g["momentum"] = pg.momentum
            # The group's lr_mult stays in the job: every push carries the
            # base lr (the torch group's), the shards multiply.
            groups.append(g)
        return job, groups, defaults

    def _map_tensors(self):
        names = self._names() or {}
        tensors, seen = [], set()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in the param groups")
                seen.add(id(p))
                if self._model is not None:
                    if id(p) not in names:
                        raise ValueError(f"parameter {pi} of group {gi} (shape "
                                         f"{tuple(p.shape)}) is not a parameter of model")
                    name = names[id(p)]
                else:
                    name = f"group{gi}.{pi}"
                if p.dtype != torch.float32:
                    raise ValueError(f"parameter {name} is {p.dtype}; optimus keeps fp32 "
                                     "master weights, so parameters must be float32")
                if p.device.type != "cpu":
                    raise ValueError(f"parameter {name} is on {p.device}; this version moves "
                                     "CPU tensors only")
                tensors.append(_Tensor(len(tensors), name, p, gi))
        if not tensors:
            raise ValueError("DistributedOptimizer got no parameters")
        return tensors

    def _fill_job(self, job, from_spec):
        """The job's tensors in torch's order (group by group, as state_dict
        indexes them); without a spec, its groups and optimizer from torch's
        param groups (lr_mult 1: each push carries its group's lr)."""
        job.tensors = [_C.TensorDef(t.name, list(t.param.shape), t.group,
                                    not t.param.requires_grad) for t in self._tensors]
        if from_spec:
            return
        job.name = "optimus-job"  # $OPTIMUS_JOB or job_name= override it.
        spec = job.optimizer
        g0 = self.defaults
        spec.lr = float(g0["lr"]) if g0["lr"] > 0 else _TINY_LR
        spec.beta1, spec.beta2 = (float(b) for b in g0["betas"])
        spec.eps = float(g0["eps"])
        spec.weight_decay = float(g0["weight_decay"])
        spec.momentum = float(g0["momentum"])
        job.optimizer = spec
        groups = []
        for gi, g in enumerate(self.param_groups):
            pg = _C.ParamGroup()
            pg.name = str(g.get("name", f"group{gi}"))
            pg.lr_mult = 1.0
            pg.weight_decay = float(g["weight_decay"])
            pg.beta1, pg.beta2 = (float(b) for b in g["betas"])
            pg.momentum = float(g["momentum"])
            groups.append(pg)
        job.param_groups = groups

    def _adopt(self, client):
        """Takes the joined client: staging buffers of its dtypes, registered."""
        self._client = client
        self._resume = client.resume_step
        self._job_id = client.job_id
        gdt = _TORCH_DTYPES[client.grad_dtype]
        pdt = _TORCH_DTYPES[client.param_dtype]
        self._arenas = [_carve(self._tensors, gdt, "grad_stage"),
                        _carve(self._tensors, pdt, "param_stage")]
        for a in self._arenas:
            client.register_buffer(a.data_ptr(), a.numel() * a.element_size())
        for t in self._tensors:
            t.pull_ticket = None
            t.pull_version = 0
            t.staged_version = 0
            t.push_ticket = None
            t.pushed_step = self._resume - 1
            t.hook_calls = 0
            t.model_version = 0

    def _start(self):
        """Sends the initial values (rank 0 of a new job) and brings the model
        to the job's first version. Runs at the first forward or step()."""
        if self._started:
            return
        self._started = True
        c = self._client
        if self._resume == 1 and self._rank == 0:
            with torch.no_grad():
                for t in self._tensors:
                    st = self._init_state.get(t.index) if self._init_state else None
                    values = t.param.detach().contiguous()
                    if st is not None and st[3] is not None:
                        values = st[3]
                    try:
                        if st is None or (st[0] is None and st[1] is None and st[2] == 0):
                            c.init_tensor(t.index, values.data_ptr(), t.numel)
                        else:
                            m, v, steps, _ = st
                            c.init_tensor_state(t.index, values.data_ptr(),
                                                m.data_ptr() if m is not None else 0,
                                                v.data_ptr() if v is not None else 0,
                                                t.numel, steps)
                    except optimus.AlreadyExists:
                        pass  # A restarted rank 0 of a job that has its values.
        self._init_state = None
        self._pull_all(self._resume)
        self._step = self._resume

    def _pull_all(self, version):
        """Pulls every tensor at `version` into the model (blocking)."""
        c = self._client
        for t in self._tensors:
            self._wait_pull(t)
        tickets = []
        c.cork()
        try:
            for t in self._tensors:
                tickets.append(c.pull(t.index, version, t.param_stage.data_ptr(), t.numel))
        finally:
            c.uncork()
        c.wait_all(tickets, self._timeout)
        with torch.no_grad():
            for t in self._tensors:
                t.param.copy_(t.param_stage)
                t.staged_version = 0
                t.pull_version = version
                t.model_version = version

    def _install_hooks(self):
        # In mode "none" the hooks only count (which parameters got a
        # gradient this step); step() pushes.
        with torch.enable_grad():
            for t in self._tensors:
                if not t.param.requires_grad:
                    continue
                acc = t.param.expand_as(t.param).grad_fn.next_functions[0][0]
                h = acc.register_hook(self._make_grad_hook(t))
                self._hooks.append((acc, h))
        if self._model is not None:
            owned = {}
            for t in self._tensors:
                owned[id(t.param)] = t
            for module in self._model.modules():
                mine = [owned[id(p)] for p in module.parameters(recurse=False) if id(p) in owned]
                if module is self._model or mine:
                    self._hooks.append(module.register_forward_pre_hook(
                        self._make_pre_hook(mine, root=module is self._model)))

    def remove_hooks(self):
        """Takes the autograd and forward hooks off (close() does)."""
        for h in self._hooks:
            if isinstance(h, tuple):
                h[1].remove()
            else:
                h.remove()
        self._hooks = []

    # ------------------------------------------------------------- the hooks

    def _make_pre_hook(self, mine, root):
        def pre_hook(module, inputs):
            try:
                if root:
                    self._start()
                    self._forward_clock = 0
                    if self._need_pull_all:
                        self._need_pull_all = False
                        self._pull_all(self._step)
                for t in mine:
                    t.order = self._forward_clock
                    self._forward_clock += 1
                    self._bring_in(t)
            except optimus.OptimusError as e:
                if not (self._follow_rollback and _job_lost(e)):
                    raise
                self._rejoin(e)
        return pre_hook

    def _bring_in(self, t):
        """Forward of step self._step: the model's copy of t gets the version
        this step computes on."""
        if self._mode == "layerwise":
            self._wait_pull(t)
            self._copy_staged(t)
        elif self._mode == "delayed":
            # The version pulled during the last step (if any) goes in; the
            # pull of this step's version starts now, behind it.
            if t.pull_ticket is not None and t.pull_version < self._step:
                self._wait_pull(t)
            self._copy_staged(t)
            if self._step > self._resume and t.pull_ticket is None and \
                    t.pull_version < self._step:
                self._issue_pull(t, self._step)

    def _make_grad_hook(self, t):
        def grad_hook(grad_inputs, grad_outputs):
            t.hook_calls += 1
            if self._mode == "none" or t.hook_calls != self._bpps or \
                    self._deferred is not None:
                return
            try:
                self._push(t, t.param.grad, from_hook=True)
            except optimus.OptimusError as e:
                if self._follow_rollback and _job_lost(e):
                    self._deferred = e   # step() re-joins.
                else:
                    raise
        return grad_hook

    # ------------------------------------------------------ pushes and pulls

    def _issue_pull(self, t, version):
        t.pull_ticket = self._client.pull(t.index, version, t.param_stage.data_ptr(), t.numel)
        t.pull_version = version

    def _wait_pull(self, t):
        if t.pull_ticket is None:
            return
        ticket, t.pull_ticket = t.pull_ticket, None
        self._client.wait(ticket, self._timeout)
        t.staged_version = t.pull_version

    def _copy_staged(self, t):
        if t.staged_version > t.model_version:
            with torch.no_grad():
                t.param.copy_(t.param_stage)
            t.model_version = t.staged_version
        t.staged_version = 0

    def _wait_push(self, t):
        if t.push_ticket is None:
            return
        ticket, t.push_ticket = t.push_ticket, None
        self._client.wait(ticket, self._timeout)

    def _current_grad_mult(self):
        s = self._loss_scale
        if s is None:
            return 0.0
        scale = float(s.get_scale()) if hasattr(s, "get_scale") else float(s)
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"loss scale {scale} is not a positive number")
        return 1.0 / scale

    def _push(self, t, grad, from_hook=False):
        """Pushes t's gradient (None: no gradient) for self._step."""
        if not self._started:
            self._start()
        step = self._step
        if t.pushed_step >= step:
            return
        # The chunk must be at version `step` before a push of `step`.
        if self._mode == "delayed" and step > self._resume:
            if t.pull_ticket is None and t.pull_version < step:
                self._issue_pull(t, step)
            self._wait_pull(t)
        elif t.pull_ticket is not None:
            # Used before its module's pre-hook ran (a parameter shared
            # across modules): its values are brought in now.
            if from_hook and not self._warned_stale and self._mode == "layerwise":
                self._warned_stale = True
                warnings.warn(f"optimus: parameter {t.name} got a gradient before its module's "
                              "forward pre-hook brought its new values in; this step used "
                              "the previous ones. Use mode='none' for such models.")
            self._wait_pull(t)
            self._copy_staged(t)
        self._wait_push(t)
        addr = 0
        if grad is not None and t.param.requires_grad:
            with torch.no_grad():
                t.grad_stage.copy_(grad)
            addr = t.grad_stage.data_ptr()
        lr = float(self.param_groups[t.group]["lr"])
        if lr < 0:
            raise ValueError(f"param_groups[{t.group}]['lr'] = {lr} is negative")
        t.push_ticket = self._client.push(t.index, step, addr, t.numel,
                                          lr=lr,
                                          grad_mult=self._current_grad_mult())
        t.pushed_step = step

    # -------------------------------------------------------------- the step

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Ends step self.step_count: pushes what backward did not (parameters
        without a gradient go as "no gradient"), then starts the pulls of the
        result (mode "layerwise"; "delayed" pulls during the next forward,
        "none" before it). Returns closure's loss when given one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is not None and self._loss_scale is None:
            if self._mode != "none":
                raise ValueError(
                    "DistributedOptimizer(loss_scale=scaler) is needed with a GradScaler: the "
                    "gradients leave during backward, before GradScaler.step calls step()")
            self._loss_scale = grad_scaler
        for attempt in range(2):
            try:
                self._finish_step()
                break
            except optimus.OptimusError as e:
                if not (self._follow_rollback and _job_lost(e)) or attempt == 1:
                    raise
                self._deferred = None
                self._rejoin(e)
                return loss
        if grad_scaler is not None:
            self._report_found_inf(grad_scaler)
        return loss

    def _finish_step(self):
        if self._deferred is not None:
            e, self._deferred = self._deferred, None
            raise e
        if not self._started:
            self._start()
        c = self._client
        step = self._step
        todo = [t for t in self._tensors if t.pushed_step < step]
        if self._mode == "delayed" and step > self._resume:
            # Their chunks must be at version `step` first (no forward of
            # theirs started the pull). Never wait on a corked request.
            for t in todo:
                if t.pull_ticket is None and t.pull_version < step:
                    self._issue_pull(t, step)
            for t in todo:
                self._wait_pull(t)
        c.cork()
        try:
            for t in todo:
                self._push(t, t.param.grad if t.hook_calls > 0 else None)
        finally:
            c.uncork()
        for t in self._tensors:
            t.hook_calls = 0
        self._step = step + 1
        if self._mode == "none":
            for t in self._tensors:
                self._wait_push(t)
            if self._model is None:
                self._pull_all(self._step)
            else:
                self._need_pull_all = True
        elif self._mode == "layerwise":
            # Pulls of the next version, in the order the forward used them.
            c.cork()
            try:
                for t in sorted(self._tensors, key=lambda t: t.order):
                    if t.pull_ticket is not None:  # Never brought in (module unused).
                        self._wait_pull(t)
                        self._copy_staged(t)
                    self._issue_pull(t, self._step)
            finally:
                c.uncork()
            if self._model is None:
                for t in self._tensors:
                    self._wait_pull(t)
                    self._copy_staged(t)
        # "delayed": the next forward's pre-hooks start the pulls.

    def _report_found_inf(self, scaler):
        """GradScaler protocol (_step_supports_amp_scaling): records the step's
        found_inf where GradScaler.update() reads it."""
        report = self.last_step_report
        found = 1.0 if report is not None and report.found_inf else 0.0
        try:
            scale = scaler._scale if scaler._scale is not None else None
            device = scale.device if scale is not None else torch.device("cpu")
            state = scaler._per_optimizer_states[id(self)]
            state["found_inf_per_device"] = {device: torch.full((1,), found, device=device)}
        except (AttributeError, KeyError, TypeError):
            pass

    # --------------------------------------------------------------- reports

    @property
    def step_count(self):
        """The step the next backward computes (1 for a new job)."""
        return self._step if self._started else self._resume

    @property
    def last_step_report(self):
        """What the shards decided for the last step (grad_norm, clip_coef,
        found_inf, skipped): an optimus.StepReport, or None before the first
        step or for a job that neither clips nor skips non-finite steps.
        Waits until every rank's pushes of that step are in."""
        step = self._step - 1
        if step < max(self._resume, 1) or not (self._max_grad_norm > 0 or self._skip_nonfinite):
            return None
        if step not in self._reports:
            try:
                self._reports[step] = self._client.step_result(step, self._timeout)
            except optimus.FailedPrecondition:
                return None
            if len(self._reports) > 64:
                del self._reports[min(self._reports)]
        return self._reports[step]

    @property
    def grad_norm(self):
        """The last step's global gradient norm (after 1/loss_scale, before
        clipping), as torch.nn.utils.clip_grad_norm_ returns it: a float
        (inf/NaN when the gradient was not finite), or None (see
        last_step_report)."""
        r = self.last_step_report
        return None if r is None else r.grad_norm

    @property
    def client(self):
        """The optimus.Client in use (it changes after a re-join)."""
        return self._client

    @property
    def job_name(self):
        return self._job_name

    @property
    def mode(self):
        return self._mode

    # ------------------------------------------------------------ lifecycle

    def synchronize(self):
        """Waits for every request in flight and brings the model's
        parameters to the newest version (after the last step())."""
        if not self._started:
            self._start()
            return
        target = self._step
        for t in self._tensors:
            self._wait_push(t)
            if t.pull_ticket is not None:
                self._wait_pull(t)
                self._copy_staged(t)
        todo = [t for t in self._tensors if t.model_version < target]
        tickets = [self._client.pull(t.index, target, t.param_stage.data_ptr(), t.numel)
                   for t in todo]
        self._client.wait_all(tickets, self._timeout)
        with torch.no_grad():
            for t in todo:
                t.param.copy_(t.param_stage)
                t.pull_version = t.model_version = target
        self._need_pull_all = False

    def close(self, leave=True):
        """synchronize(), leave the job (so that it can be deleted once every
        rank left), take the hooks off and stop the client."""
        if self._client is None:
            return
        try:
            self.synchronize()
            if leave:
                try:
                    self._client.leave()
                except optimus.OptimusError as e:
                    warnings.warn(f"optimus: leaving job '{self._job_name}': {e}")
        finally:
            self.remove_hooks()
            self._drop_client()

    def _drop_client(self):
        c, self._client = self._client, None
        if c is None:
            return
        for a in self._arenas:
            try:
                c.forget_buffer(a.data_ptr(), a.numel() * a.element_size())
            except optimus.OptimusError:
                pass
        c.close()

    def __del__(self):
        try:
            if getattr(self, "_client", None) is not None:
                self.remove_hooks()
                self._drop_client()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _rejoin(self, why):
        """The job failed (or was replaced by the restore of its checkpoint):
        joins the restored job (client::RejoinAfterRollback) and pulls its
        resume step's parameters into the model."""
        warnings.warn(f"optimus: step {self._step} failed ({why}); re-joining job "
                      f"'{self._job_name}'")
        old = self._client
        if old is not None:
            for a in self._arenas:
                try:
                    old.forget_buffer(a.data_ptr(), a.numel() * a.element_size())
                except optimus.OptimusError:
                    pass
        self._adopt(self._session.rejoin())
        self._started = True
        self._reports.clear()
        self._deferred = None
        self._need_pull_all = False
        self._pull_all(self._resume)
        self._step = self._resume
        for t in self._tensors:
            t.hook_calls = 0

    # ------------------------------------------------------------ state dicts

    def add_param_group(self, param_group):
        if getattr(self, "_tensors", None) is not None:
            raise RuntimeError("DistributedOptimizer: the job's tensors are fixed when it is "
                               "created; add_param_group after construction is not supported")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=False):
        super().zero_grad(set_to_none=set_to_none)

    _MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                "sgd": ("momentum_buffer",), "lion": ("exp_avg",)}

    def load_state_dict(self, state_dict):
        """Takes a torch.optim state_dict (e.g. torch.optim.AdamW's, or this
        class's, whose fp32 master weights are then used too): its
        param_groups' hyperparameters (lr, betas, weight_decay, ...) as torch
        does, and its per-parameter state (moments, step) as the new job's
        starting state: rank 0 sends it with the model's current values as
        master weights when it starts the job (InitTensorState), so call it
        before the first forward or step(). Other ranks keep only the
        hyperparameters. A job already started, or one restored from a
        checkpoint, keeps its own state (a warning says so)."""
        masters = (state_dict.get("optimus") or {}).get("master") or {}
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "optimus"})
        states = {}
        for t in self._tensors:
            st = self.state.pop(t.param, None)
            if st or t.name in masters:
                states[t.index] = (t, st or {})
        self.state.clear()
        if not states:
            return
        names = self._MOMENTS[self._kind]
        init = {}
        for index, (t, st) in states.items():
            master = masters.get(t.name)
            if master is not None:  # This class's state_dict: fp32 masters too.
                master = master.detach().to(torch.float32).contiguous()
                if tuple(master.shape) != tuple(t.param.shape):
                    raise ValueError(f"master of {t.name} has shape {tuple(master.shape)}")
            if not st:
                init[index] = (None, None, 0, master)
                continue
            extra = sorted(k for k in st if k != "step" and k not in names)
            if extra:
                raise ValueError(f"state of parameter {index} ({t.name}) holds {extra}, which "
                                 f"optimus's {self._kind} does not keep (its state: "
                                 f"{list(names)})")
            if self._kind in ("adamw", "adam") and "step" not in st:
                raise ValueError(f"state of parameter {index} ({t.name}) has no 'step'")
            arrays = []
            for n in names:
                v = st.get(n)
                if v is not None:
                    if tuple(v.shape) != tuple(t.param.shape):
                        raise ValueError(f"state {n} of parameter {index} ({t.name}) has shape "
                                         f"{tuple(v.shape)}, the parameter {tuple(t.param.shape)}")
                    v = v.detach().to(torch.float32).contiguous()
                arrays.append(v)
            while len(arrays) < 2:
                arrays.append(None)
            steps = int(float(st.get("step", 0)))
            init[index] = (arrays[0], arrays[1], steps, master)
        if self._rank != 0:
            return
        if self._started or self._resume != 1:
            warnings.warn(f"optimus: job '{self._job_name}' already holds its optimizer state "
                          f"(step {self.step_count}); load_state_dict kept only the "
                          "hyperparameters")
            return
        self._init_state = init

    def state_dict(self):
        """torch.optim's layout, which torch.optim.AdamW.load_state_dict (and
        this class's) accepts: "param_groups" (hyperparameters, parameter
        indices) and "state" (per parameter that has stepped: 'step' and the
        moments, exp_avg / exp_avg_sq for Adam and AdamW). The moments live
        on the shards: the coordinator checkpoints the job at the current
        step and they are read from that checkpoint, so the coordinator and
        shards need --checkpoint_dir, on a folder this process can read (the
        same machine or a shared filesystem). Also "optimus": the job name,
        the step and the fp32 master weights by parameter name. Call it on
        one rank between step() and the next backward (it waits for the
        step's pushes; other ranks wait meanwhile)."""
        sd = super().state_dict()
        self.synchronize()
        step = self._step
        masters = {}
        sd["optimus"] = {"job_name": self._job_name, "step": step, "master": masters}
        if step <= 1:
            return sd  # No step taken: torch has no state either.
        path = _C.checkpoint_at(self._coordinator, self._job_name, step, self._timeout,
                                job_token=self._client.job_token)
        info = _C.read_checkpoint(path)
        arrays = info["arrays"]
        names = self._MOMENTS[self._kind]
        state = {}
        for t in self._tensors:
            bufs = [torch.empty(t.param.shape, dtype=torch.float32) for _ in arrays]
            _C.read_checkpoint_tensor(path, t.index, [b.data_ptr() for b in bufs], t.numel)
            by_name = dict(zip(arrays, bufs))
            masters[t.name] = by_name.get("master", bufs[0])
            steps = info["tensors"][t.index]["optimizer_steps"]
            if steps == 0:
                continue  # Never stepped (no gradient yet, or frozen): torch keeps no state.
            entry = {}
            if self._kind in ("adamw", "adam"):
                entry["step"] = torch.tensor(float(steps))
            for n in names:
                if n in by_name:
                    entry[n] = by_name[n]
            state[t.index] = entry
        sd["state"] = state
        return sd
