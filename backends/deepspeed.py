"""``deepspeed``: DeepSpeed's engine, ZeRO stages 0 to 3.

    deepspeed --num_gpus 2 recipes/cifar10.py --backend deepspeed --zero-stage 2

DeepSpeed builds the model engine and the optimizer together, so use
``backend.setup(model, optimizer)``; ``wrap_optimizer`` alone cannot work and
says so.  The optimizer returned by ``setup`` is a thin adapter whose
``step()`` and ``zero_grad()`` call the engine's, so the training loop stays
``backend.backward(loss); optimizer.step(); optimizer.zero_grad()``.

The config comes from the constructor (``micro_batch_size``, ``zero_stage``)
or from a user's JSON file (``config="ds_config.json"``); options given
explicitly override the file.  Without a GPU DeepSpeed picks its CPU
accelerator and communicates over Gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx.backend import ProcessGroupBackend, warn
from parallelx.errors import BackendUnavailableError, LaunchError, ParallelxError

INSTALL_HINT = "pip install 'deepspeed==0.19.8' (or pip install 'parallelx[deepspeed]')"


def remove_shm_buffers(port: str | int | None, addr: str | None = "*", rank: int | str = "*") -> None:
    """Delete DeepSpeed's CPU all-reduce buffers of one launch (its master
    port), optionally of one address and rank.  Each rank maps a 69 MB file
    into /dev/shm (RAM), named by master address, port and rank, and DeepSpeed
    never removes it: every launch on a new port would leak one per rank, and
    a crashed or killed rank cannot clean up after itself."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        path.unlink(missing_ok=True)  # mappings stay valid until the process exits


class DeepSpeedOptimizer:
    """The optimizer side of a DeepSpeed engine, shaped like a torch optimizer.

    ``step()`` runs ``engine.step()`` (gradient reduction at the boundary,
    the ZeRO update, the engine's step counters); ``zero_grad()`` clears the
    engine's gradients.  Everything else (``param_groups`` for learning-rate
    schedules, ``state``) is the underlying optimizer's.
    """

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.engine = engine
        self.optimizer = optimizer

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ParallelxError("deepspeed: optimizer.step(closure) is not supported")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class DeepSpeedBackend(ProcessGroupBackend):
    name = "deepspeed"
    requires_module = "deepspeed"
    install_hint = INSTALL_HINT

    def __init__(self, *, zero_stage: int | None = None, micro_batch_size: int | None = None,
                 config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                 gradient_accumulation_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
            raise ParallelxError(f"deepspeed: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ParallelxError(f"deepspeed: micro_batch_size must be >= 1, got {micro_batch_size}")
        self.config = self._build_config(config, zero_stage, micro_batch_size, gradient_accumulation_steps)

    @staticmethod
    def _build_config(config: str | os.PathLike[str] | Mapping[str, Any] | None, zero_stage: int | None,
                      micro_batch_size: int | None, gas: int | None) -> dict[str, Any]:
        if config is None:
            cfg: dict[str, Any] = {}
        elif isinstance(config, Mapping):
            cfg = json.loads(json.dumps(config))  # a deep copy we may edit
        else:
            path = Path(config)
            if not path.is_file():
                raise ParallelxError(f"deepspeed: config file {path} does not exist")
            try:
                cfg = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ParallelxError(f"deepspeed: config file {path} is not valid JSON: {exc}") from None
        if micro_batch_size is not None:
            cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
            cfg.pop("train_batch_size", None)  # recomputed by DeepSpeed from micro x gas x world
        if gas is not None:
            cfg["gradient_accumulation_steps"] = gas
        if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" not in cfg:
            # Only DeepSpeed's bookkeeping reads it: the data loader is ours.
            cfg["train_micro_batch_size_per_gpu"] = 1
        zero = cfg.setdefault("zero_optimization", {})
        if zero_stage is not None:
            zero["stage"] = zero_stage
        zero.setdefault("stage", 0)
        # Plain torch optimizers (SGD) are what the recipes use; ZeRO runs them fine.
        cfg.setdefault("zero_allow_untested_optimizer", True)
        cfg.setdefault("steps_per_print", 2**31 - 1)
        return cfg

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("deepspeed")
        group.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                           help="ZeRO stage (default: the config file's, else 0)")
        group.add_argument("--deepspeed-config", default=None, metavar="JSON",
                           help="a DeepSpeed config file; explicit options override it")
        # The deepspeed launcher appends --local_rank=N to the script's argv.
        group.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        options = super().options_from_args(args)
        options.update(zero_stage=getattr(args, "zero_stage", None), config=getattr(args, "deepspeed_config", None),
                       micro_batch_size=getattr(args, "batch_size", None))
        return options

    @property
    def zero_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    @classmethod
    def detect(cls, environ: Mapping[str, str], argv: Sequence[str]) -> int:
        launched = "CROSS_RANK" in environ or any(a.startswith(("--local_rank", "--local-rank")) for a in argv[1:])
        return 20 if launched and "RANK" in environ and "TORCHELASTIC_RUN_ID" not in environ else 0

    def init(self) -> None:
        try:
            import deepspeed
        except ImportError as exc:
            raise BackendUnavailableError(f"deepspeed does not import ({exc}); {INSTALL_HINT}") from None
        if "RANK" not in os.environ:
            raise LaunchError("deepspeed: not started by a launcher; run "
                              "`deepspeed --num_gpus N your_script.py --backend deepspeed ...`")
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.ds = deepspeed
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._device = self._pick_device()
        deepspeed.init_distributed(dist_backend=self._dist_backend(), verbose=False,
                                   timeout=_dt.timedelta(seconds=self.timeout_s))
        import torch.distributed as dist

        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._local_world_size = int(os.environ.get("LOCAL_SIZE", self._world_size))
        self._limit_cpu_threads(self._local_world_size)
        self._initialized = True

    def shutdown(self) -> None:
        if self._initialized:
            self.barrier()  # every rank is done with the buffers
            remove_shm_buffers(os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR"), self.rank)
        super().shutdown()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """An engine without an optimizer: good for evaluation only."""
        self._require_init()
        engine, *_ = self.ds.initialize(model=model, config=self.config)
        return self._remember(engine)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        raise ParallelxError("deepspeed builds the engine from the model and the optimizer together: "
                             "use `model, optimizer = backend.setup(model, optimizer)`")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[nn.Module, Any]:
        self._require_init()
        if optimizer is None:
            return self.wrap_model(model), None
        engine, ds_optimizer, _, _ = self.ds.initialize(model=model, optimizer=optimizer, config=self.config)
        return self._remember(engine), DeepSpeedOptimizer(engine, ds_optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        engine = getattr(self, "_engine_for_backward", None)
        if engine is None:
            raise ParallelxError("deepspeed: call backend.setup(model, optimizer) before backward()")
        engine.backward(loss)

    # DeepSpeed's backward belongs to the engine; remember the last one set up.
    def _remember(self, engine: Any) -> Any:
        self._engine_for_backward = engine
        return engine

    @contextlib.contextmanager
    def _gathered(self, module: nn.Module) -> Iterator[None]:
        """Under ZeRO-3 each rank holds a slice of every parameter: gather them
        (a collective) for the duration of the block."""
        if self.zero_stage == 3:
            with self.ds.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with self._gathered(self.unwrap(model)):
            return super().model_state_dict(model)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        if self.zero_stage == 0:  # DeepSpeedOptimizer.state_dict is the plain optimizer's
            return super().optimizer_state_dict(optimizer)
        warn(f"deepspeed: under ZeRO stage {self.zero_stage} the optimizer state is sharded across ranks "
             "and has no portable form; the checkpoint keeps None in its place (the weights are complete)")
        return None

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        if isinstance(target, nn.Module):
            module = self.unwrap(target)
            if self.zero_stage == 3:
                # Rank 0 loads the full tensors; DeepSpeed re-partitions them on exit.
                with self.ds.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                    if self.is_main():
                        module.load_state_dict(state)
            else:
                module.load_state_dict(state)
        elif self.zero_stage == 0:
            target.load_state_dict(state)
        else:
            raise ParallelxError(f"deepspeed: cannot load a plain optimizer state into ZeRO stage {self.zero_stage}")
