"""parallelx: one PyTorch training script, any distributed-training backend.

    parallelx.add_arguments(parser)               # --backend and every backend's options
    backend = parallelx.from_args(parser.parse_args())   # or parallelx.get_backend("auto")
    with backend:
        model = backend.wrap_model(model)
        optimizer = backend.wrap_optimizer(optimizer)

Importing parallelx imports neither horovod nor deepspeed.
"""

from parallelx import _compat  # noqa: F401  (the old module paths of 0.3, for one release)
from parallelx.backend import Backend, ReduceOp
from parallelx.bigmodels.export import save_pretrained
from parallelx.bigmodels.meta import init_module, init_weights
from parallelx.bigmodels.pretrained import load_pretrained
from parallelx.checkpoints.checkpointer import Checkpointer
from parallelx.checkpoints.trainstate import (
    latest_checkpoint,
    load_training_state,
    save_training_state,
    wait_for_checkpoint,
)
from parallelx.cli import add_arguments, exit_on_error, from_args
from parallelx.errors import BackendUnavailableError, LaunchError, ParallelxError, UnknownBackendError
from parallelx.launching.launchers import Launcher
from parallelx.log import warn
from parallelx.parts.sampler import ShardedSampler
from parallelx.registry import (
    available_backends,
    backend_class,
    describe,
    detect_backend,
    get_backend,
    register_backend,
)
from parallelx.strategies.process_group import ProcessGroupStrategy
from parallelx.strategies.single_process import SingleProcessStrategy
from parallelx.strategy import BackendSpec, Joined, Options, Strategy
from parallelx.training.ema import EMA
from parallelx.training.main_process import get_logger, local_main_process_first, main_process_first
from parallelx.training.metrics import MetricSums, real_mask
from parallelx.training.preemption import Preemption
from parallelx.utils import seed_everything
from parallelx.version import __version__

__all__ = [
    "EMA",
    "Backend",
    "BackendSpec",
    "BackendUnavailableError",
    "Checkpointer",
    "Joined",
    "LaunchError",
    "Launcher",
    "MetricSums",
    "Options",
    "ParallelxError",
    "Preemption",
    "ProcessGroupStrategy",
    "ReduceOp",
    "ShardedSampler",
    "SingleProcessStrategy",
    "Strategy",
    "UnknownBackendError",
    "__version__",
    "add_arguments",
    "available_backends",
    "backend_class",
    "describe",
    "detect_backend",
    "exit_on_error",
    "from_args",
    "get_backend",
    "get_logger",
    "init_module",
    "init_weights",
    "latest_checkpoint",
    "load_pretrained",
    "load_training_state",
    "local_main_process_first",
    "main_process_first",
    "real_mask",
    "register_backend",
    "save_pretrained",
    "save_training_state",
    "seed_everything",
    "wait_for_checkpoint",
    "warn",
]
