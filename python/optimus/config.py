"""Job specs as files (docs/job-spec.md): a JSON or YAML document in the style
of a DeepSpeed config, read into a JobConfig.

    name: gpt-small
    optimizer:
      type: AdamW
      params: {lr: 6.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1}
    gradient_clipping: 1.0
    dtypes: {grad: bf16, param: bf16}
    replication: 0
    checkpoint: {every_steps: 500, keep_last: 3}
    param_groups:
      - {name: no_decay, match: ["*.bias", "*norm*"], weight_decay: 0}
      - {name: decay}

This is the Python reading of the schema (YAML through python3-yaml); every
field is optional and unknown fields are errors naming the field.
"""

import fnmatch
import json
import re

_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class JobConfig:
    """What a job spec sets; None (or empty) where it sets nothing."""

    def __init__(self):
        self.source = "<inline>"
        self.name = None
        self.world_size = None
        self.optimizer = None          # "adamw", "adam", "sgd", "lion"
        self.lr = None
        self.betas = None
        self.eps = None
        self.weight_decay = None
        self.momentum = None
        self.grad_scale = None
        self.gradient_clipping = None
        self.skip_nonfinite = None
        self.grad_dtype = None
        self.param_dtype = None
        self.chunk_payload_bytes = None
        self.max_chunk_bytes = None
        self.replication = None
        self.checkpoint_every_steps = None
        self.checkpoint_every_seconds = None
        self.checkpoint_keep_last = None
        # [{"name", "match": [globs] (empty: the default group), "weight_decay",
        #   "lr_mult", "betas", "momentum"}]
        self.param_groups = []
        self.tensors = []               # [{"name", "shape", "group", "frozen"}]

    def group_of(self, tensor_name):
        """The index in param_groups of the group `tensor_name` joins: the
        first whose patterns match, else the one without `match`; None when
        neither exists (the caller adds a default group)."""
        default = None
        for i, g in enumerate(self.param_groups):
            if not g["match"]:
                default = i if default is None else default
            elif any(fnmatch.fnmatchcase(tensor_name, p) for p in g["match"]):
                return i
        return default


class _Reader:
    def __init__(self, source):
        self.source = source

    def fail(self, field, msg):
        raise ValueError(f"{self.source}: {field}: {msg}")

    def mapping(self, v, field, known):
        if not isinstance(v, dict):
            self.fail(field, f"expected a mapping, got {v!r}")
        for k in v:
            if k not in known:
                self.fail(f"{field}.{k}" if field else k,
                          f"unknown field (known here: {', '.join(known)})")
        return v

    def number(self, v, field, lo=0.0, hi=None, lo_open=False, hi_open=False):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(field, f"expected a number, got {v!r}")
        v = float(v)
        if (v <= lo if lo_open else v < lo) or (hi is not None and (v >= hi if hi_open else v > hi)):
            self.fail(field, f"{v} is out of range")
        return v

    def whole(self, v, field, lo=0, hi=None):
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(field, f"expected a whole number, got {v!r}")
        if v < lo or (hi is not None and v > hi):
            self.fail(field, f"{v} is out of range [{lo}, {hi}]")
        return v

    def size(self, v, field):
        if isinstance(v, int) and not isinstance(v, bool):
            return self.whole(v, field)
        m = _SIZE.match(str(v))
        if not m:
            self.fail(field, f"expected a size (4194304, 4MiB, 512KiB), got {v!r}")
        return int(m.group(1)) * _UNITS[m.group(2)]

    def betas(self, v, field):
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            self.fail(field, f"expected [beta1, beta2], got {v!r}")
        return tuple(self.number(b, f"{field}[{i}]", 0.0, 1.0, hi_open=True)
                     for i, b in enumerate(v))

    def dtype(self, v, field):
        if v not in ("bf16", "fp16", "fp32"):
            self.fail(field, f"expected bf16, fp16 or fp32, got {v!r}")
        return v


def parse_job_config(text, source="<inline>"):
    """Parses a job spec (JSON or YAML text); ValueError naming the source and
    the field for anything wrong."""
    r = _Reader(source)
    try:
        doc = json.loads(text)
    except ValueError:
        try:
            import yaml  # python3-yaml
        except ImportError as e:  # pragma: no cover
            raise ValueError(f"{source}: not JSON, and YAML needs python3-yaml ({e})") from e
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{source}: {e}") from e
    if doc is None:
        doc = {}
    cfg = JobConfig()
    cfg.source = source
    r.mapping(doc, "", ["name", "world_size", "optimizer", "gradient_clipping",
                        "skip_nonfinite", "dtypes", "chunk_payload_bytes", "max_chunk_bytes",
                        "replication", "checkpoint", "param_groups", "tensors"])
    if "name" in doc:
        if not isinstance(doc["name"], str) or not doc["name"]:
            r.fail("name", f"expected a job name, got {doc['name']!r}")
        cfg.name = doc["name"]
    if "world_size" in doc:
        cfg.world_size = r.whole(doc["world_size"], "world_size", 1, 65536)
    if "optimizer" in doc:
        o = r.mapping(doc["optimizer"], "optimizer", ["type", "params"])
        if "type" in o:
            t = str(o["type"]).lower()
            if t not in ("adamw", "adam", "sgd", "lion"):
                r.fail("optimizer.type", f"expected adamw, adam, sgd or lion, got {o['type']!r}")
            cfg.optimizer = t
        p = r.mapping(o.get("params", {}), "optimizer.params",
                      ["lr", "betas", "eps", "weight_decay", "momentum", "grad_scale"])
        for k in ("lr", "eps", "weight_decay", "momentum", "grad_scale"):
            if k in p:
                setattr(cfg, k, r.number(p[k], f"optimizer.params.{k}"))
        if "betas" in p:
            cfg.betas = r.betas(p["betas"], "optimizer.params.betas")
    if "gradient_clipping" in doc:
        cfg.gradient_clipping = r.number(doc["gradient_clipping"], "gradient_clipping")
    if "skip_nonfinite" in doc:
        if not isinstance(doc["skip_nonfinite"], bool):
            r.fail("skip_nonfinite", f"expected true or false, got {doc['skip_nonfinite']!r}")
        cfg.skip_nonfinite = doc["skip_nonfinite"]
    if "dtypes" in doc:
        d = r.mapping(doc["dtypes"], "dtypes", ["grad", "param"])
        if "grad" in d:
            cfg.grad_dtype = r.dtype(d["grad"], "dtypes.grad")
        if "param" in d:
            cfg.param_dtype = r.dtype(d["param"], "dtypes.param")
    for k in ("chunk_payload_bytes", "max_chunk_bytes"):
        if k in doc:
            setattr(cfg, k, r.size(doc[k], k))
    if "replication" in doc:
        cfg.replication = r.whole(doc["replication"], "replication", 0, 1)
    if "checkpoint" in doc:
        c = r.mapping(doc["checkpoint"], "checkpoint", ["every_steps", "every_seconds", "keep_last"])
        for k in ("every_steps", "every_seconds", "keep_last"):
            if k in c:
                setattr(cfg, f"checkpoint_{k}", r.whole(c[k], f"checkpoint.{k}"))
    if "param_groups" in doc:
        if not isinstance(doc["param_groups"], list):
            r.fail("param_groups", "expected a list of groups")
        defaults = 0
        for i, g in enumerate(doc["param_groups"]):
            f = f"param_groups[{i}]"
            r.mapping(g, f, ["name", "match", "weight_decay", "lr_mult", "betas", "momentum"])
            match = g.get("match", [])
            if isinstance(match, str):
                match = [match]
            if not isinstance(match, list) or not all(isinstance(m, str) for m in match):
                r.fail(f"{f}.match", f"expected a glob or a list of globs, got {match!r}")
            group = {"name": str(g.get("name", f"group{i}")), "match": match}
            for k in ("weight_decay", "lr_mult", "momentum"):
                group[k] = r.number(g[k], f"{f}.{k}") if k in g else None
            group["betas"] = r.betas(g["betas"], f"{f}.betas") if "betas" in g else None
            if not match:
                defaults += 1
                if defaults > 1:
                    r.fail(f"{f}.match", "a second group without `match` (at most one default group)")
            cfg.param_groups.append(group)
    if "tensors" in doc:
        if not isinstance(doc["tensors"], list):
            r.fail("tensors", "expected a list of {name, shape, group, frozen}")
        for i, t in enumerate(doc["tensors"]):
            r.mapping(t, f"tensors[{i}]", ["name", "shape", "group", "frozen"])
            cfg.tensors.append(dict(t))
    return cfg


def load_job_config(path):
    """Reads and parses the job spec file at `path`."""
    with open(path) as f:
        return parse_job_config(f.read(), path)
