"""parallelx: one PyTorch training script, any distributed-training backend.

    parallelx.add_arguments(parser)               # --backend and every backend's options
    backend = parallelx.from_args(parser.parse_args())   # or parallelx.get_backend("auto")
    with backend:
        model = backend.wrap_model(model)
        optimizer = backend.wrap_optimizer(optimizer)

Importing parallelx imports neither horovod nor deepspeed.
"""

from .cli import add_arguments, exit_on_error, from_args
from .errors import BackendUnavailableError, LaunchError, ParallelxError, UnknownBackendError
from .launch import Launcher
from .local import LocalBackend
from .log import warn
from .main_process import get_logger, local_main_process_first, main_process_first
from .metrics import MetricSums, real_mask
from .preempt import Preemption
from .process_group import ProcessGroupBackend
from .protocol import Backend, ReduceOp
from .registry import available_backends, backend_class, detect_backend, get_backend, register_backend
from .sampler import ShardedSampler
from .trainstate import latest_checkpoint, load_training_state, save_training_state
from .utils import seed_everything
from .version import __version__

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "LaunchError",
    "Launcher",
    "LocalBackend",
    "MetricSums",
    "ParallelxError",
    "Preemption",
    "ProcessGroupBackend",
    "ReduceOp",
    "ShardedSampler",
    "UnknownBackendError",
    "__version__",
    "add_arguments",
    "available_backends",
    "backend_class",
    "detect_backend",
    "exit_on_error",
    "from_args",
    "get_backend",
    "get_logger",
    "latest_checkpoint",
    "load_training_state",
    "local_main_process_first",
    "main_process_first",
    "real_mask",
    "register_backend",
    "save_training_state",
    "seed_everything",
    "warn",
]
