"""Job specs as files (docs/job-spec.md): a YAML or JSON document in the style
of a DeepSpeed config (optimizer, parameter groups matched by tensor name,
clipping, dtypes, replication, checkpoints), read by the project's one parser,
client/job_config.h, through the extension:

    cfg = optimus.load_job_config("job.yaml")    # optimus.JobConfig
    cfg.job.optimizer.lr, cfg.job.max_grad_norm, cfg.group_match, ...

Errors are optimus.InvalidArgument (a ValueError) naming file:line: field.
"""

from optimus._C import JobConfig, assign_groups, glob_match, load_job_config, parse_job_config  # noqa: F401

__all__ = ["JobConfig", "assign_groups", "glob_match", "load_job_config", "parse_job_config"]
