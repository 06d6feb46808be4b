"""optimus: the optimizer runs on shard servers; trainers push gradients and
pull parameters.

`optimus.Client` is liboptimus's client (client/client.h) with buffers passed
as addresses (``tensor.data_ptr()``) and element counts; the GIL is released
while it waits. Errors are ``optimus.OptimusError`` or its subclass for the
status code (``NotFound``, ``InvalidArgument``, ``Unavailable``,
``DeadlineExceeded``, ...), each with ``.code`` (e.g. ``"NOT_FOUND"``).

PyTorch trainers use ``optimus.torch.DistributedOptimizer``.
"""

from optimus._C import (  # noqa: F401
    AlreadyExists,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    JobDef,
    NotFound,
    OptimizerSpec,
    OptimusError,
    OutOfRange,
    ParamGroup,
    ResourceExhausted,
    Session,
    StepReport,
    TensorDef,
    TensorInfo,
    Unavailable,
)
from optimus.config import (  # noqa: F401
    JobConfig, assign_groups, glob_match, load_job_config, parse_job_config)

__all__ = [
    "AlreadyExists", "Client", "DeadlineExceeded", "FailedPrecondition", "Internal",
    "InvalidArgument", "JobConfig", "JobDef", "NotFound", "OptimizerSpec", "OptimusError",
    "OutOfRange", "ParamGroup", "ResourceExhausted", "StepReport", "TensorDef", "TensorInfo",
    "Session", "Unavailable", "assign_groups", "glob_match", "load_job_config",
    "parse_job_config",
]
