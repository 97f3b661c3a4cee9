"""parallelx: one PyTorch training script, any distributed-training backend.

    backend = parallelx.get_backend("auto")   # or single, dp, ddp, horovod, deepspeed
    backend.init()
    model, optimizer = backend.setup(model, optimizer)

Importing parallelx imports neither horovod nor deepspeed.
"""

from .backend import Backend, ProcessGroupBackend, ReduceOp
from .errors import BackendUnavailableError, LaunchError, ParallelxError, UnknownBackendError
from .metrics import MetricSums, real_mask
from .registry import available_backends, backend_class, detect_backend, get_backend, register_backend
from .sampler import ShardedSampler
from .utils import seed_everything

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "LaunchError",
    "MetricSums",
    "ParallelxError",
    "ProcessGroupBackend",
    "ReduceOp",
    "ShardedSampler",
    "UnknownBackendError",
    "available_backends",
    "backend_class",
    "detect_backend",
    "get_backend",
    "real_mask",
    "register_backend",
    "seed_everything",
    "__version__",
]
