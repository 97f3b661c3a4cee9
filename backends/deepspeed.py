"""``deepspeed``: DeepSpeed's engine, ZeRO stages 0 to 3.

    deepspeed --num_gpus 2 recipes/cifar10.py --backend deepspeed --zero-stage 2

DeepSpeed builds its engine from the model and the optimizer together.
``wrap_model`` returns a :class:`DeepSpeedModel` whose engine is built when the
optimizer arrives (``wrap_optimizer``), or at the first forward when there is
none; ``setup(model, optimizer)`` does both at once.  The optimizer returned is
a :class:`DeepSpeedOptimizer`, a ``torch.optim.Optimizer`` whose ``step()`` and
``zero_grad()`` are the engine's, so LR schedulers and the plain loop
(``backend.backward(loss); optimizer.step(); optimizer.zero_grad()``) work.

The config comes from the constructor (``micro_batch_size``, ``zero_stage``)
or from a user's JSON file (``config="ds_config.json"``); options given
explicitly override the file.  DeepSpeed's own defaults that change the update
are turned off unless the file sets them (see :data:`PLAIN_MATH`); a file
that does set one is honoured, and a warning says that the math now differs
from the other backends.  Without a GPU DeepSpeed picks its CPU accelerator
and communicates over Gloo.
"""

from __future__ import annotations

import argparse
import collections
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

from parallelx.errors import BackendUnavailableError, LaunchError, ParallelxError
from parallelx.launch import Launcher
from parallelx.log import warn
from parallelx.process_group import ProcessGroupBackend
from parallelx.protocol import keep_rng_state

INSTALL_HINT = "pip install 'deepspeed==0.19.8' (or pip install 'parallelx[deepspeed]')"

#: Config entries whose DeepSpeed default (or a value a user sets) makes the
#: update differ from one process on the global batch, with the plain value
#: parallelx uses.  ``gradient_clipping`` defaults to 1.0 since DeepSpeed 0.19.3.
PLAIN_MATH: dict[str, Any] = {
    "gradient_clipping": 0.0,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
}
#: Further entries that change the math when a user's config enables them.
_MATH_SECTIONS = ("fp16", "bf16", "amp", "torch_autocast")


def remove_shm_buffers(port: str | int | None, addr: str | None = "*", rank: int | str = "*") -> None:
    """Delete DeepSpeed's CPU all-reduce buffers of one launch (its master
    port), optionally of one address and rank.  Each rank maps a 69 MB file
    into /dev/shm (RAM), named by master address, port and rank, and DeepSpeed
    never removes it: every launch on a new port would leak one per rank, and
    a crashed or killed rank cannot clean up after itself."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        path.unlink(missing_ok=True)  # mappings stay valid until the process exits


DEEPSPEED = Launcher(
    name="deepspeed",
    # The deepspeed launcher takes a script path, or --module for a module.
    module="deepspeed --num_gpus {n} {opts} --module {module}",
    file="deepspeed --num_gpus {n} {opts} {file}",
    local_opts="--master_port {port}",
    local_env={"GLOO_SOCKET_IFNAME": "lo"},
    shown="file",
    cleanup=remove_shm_buffers,
)


class DeepSpeedModel(nn.Module):
    """What ``wrap_model`` returns: the user's module (``.module``) and, once
    built, its DeepSpeed engine (``.engine``).  Calls go through the engine;
    attributes the wrapper lacks are the engine's (``model.save_checkpoint``)."""

    def __init__(self, backend: DeepSpeedBackend, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        # Not registered as submodules: the engine holds the same module again.
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "engine", None)
        object.__setattr__(self, "trains", False)  # built with an optimizer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            with keep_rng_state():  # as in every set-up call: the user's random numbers stay theirs
                self._backend._build(self, None)  # no optimizer came: an engine for inference
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> DeepSpeedModel:
        super().train(mode)
        if self.engine is not None:
            self.engine.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            engine = self.__dict__.get("engine")
            if engine is None:
                raise
            return getattr(engine, name)


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """The optimizer side of a DeepSpeed engine, as a ``torch.optim.Optimizer``.

    ``step()`` runs ``engine.step()`` (gradient reduction at the boundary,
    the ZeRO update, the engine's step counters); ``zero_grad()`` clears the
    engine's gradients.  ``param_groups``, ``state`` and ``defaults`` are the
    engine's optimizer's, so an LR scheduler's changes reach the update.
    """

    # Optimizer.__init__ is not called: it would build param groups of its own,
    # and these must be the very ones DeepSpeed's optimizer steps with.
    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.engine = engine
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Any] = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Any] = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Any] = collections.OrderedDict()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return getattr(self.optimizer, "defaults", {})

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ParallelxError("deepspeed: optimizer.step(closure) is not supported; DeepSpeed steps "
                                 "after backend.backward(loss)")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ParallelxError("deepspeed: parameter groups cannot be added after the engine is built; "
                             "give every group to the optimizer before wrap_optimizer")

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({type(self.optimizer).__name__})"

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class DeepSpeedBackend(ProcessGroupBackend):
    name = "deepspeed"
    summary = "`deepspeed.initialize`, ZeRO stages 0-3 (`--zero-stage`); no clipping unless the config asks"
    launcher = DEEPSPEED
    requires_module = "deepspeed"
    install_hint = INSTALL_HINT
    probe_code = ("import deepspeed; from deepspeed.accelerator import get_accelerator; "
                  "print('deepspeed', deepspeed.__version__, 'accelerator=' + get_accelerator().device_name())")

    def __init__(self, *, zero_stage: int | None = None, micro_batch_size: int | None = None,
                 config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                 gradient_accumulation_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
            raise ParallelxError(f"deepspeed: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ParallelxError(f"deepspeed: micro_batch_size must be >= 1, got {micro_batch_size}")
        if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
            raise ParallelxError(f"deepspeed: gradient_accumulation_steps must be >= 1, "
                                 f"got {gradient_accumulation_steps}")
        user = _read_config(config)
        self.math_changes = _math_changes(user)
        self.config = self._build_config(user, zero_stage, micro_batch_size, gradient_accumulation_steps)
        self._models: list[DeepSpeedModel] = []

    @staticmethod
    def _build_config(user: dict[str, Any], zero_stage: int | None, micro_batch_size: int | None,
                      gas: int | None) -> dict[str, Any]:
        cfg = json.loads(json.dumps(user))  # a deep copy we may edit
        if micro_batch_size is not None:
            cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
            cfg.pop("train_batch_size", None)  # recomputed by DeepSpeed from micro x gas x world
        if gas is not None:
            cfg["gradient_accumulation_steps"] = gas
        if "train_micro_batch_size_per_gpu" not in cfg and "train_batch_size" not in cfg:
            # Only DeepSpeed's bookkeeping reads it: the data loader is ours.
            cfg["train_micro_batch_size_per_gpu"] = 1
        zero = cfg.setdefault("zero_optimization", {})
        if not isinstance(zero, dict):
            raise ParallelxError(f"deepspeed: config entry zero_optimization must be an object, got {zero!r}")
        if zero_stage is not None:
            zero["stage"] = zero_stage
        zero.setdefault("stage", 0)
        if zero["stage"] not in (0, 1, 2, 3):
            raise ParallelxError(f"deepspeed: zero_optimization.stage must be 0, 1, 2 or 3, got {zero['stage']!r}")
        for key, value in PLAIN_MATH.items():
            cfg.setdefault(key, value)
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

    def _init(self) -> None:
        if "RANK" not in os.environ:
            raise LaunchError(f"deepspeed: not started by a launcher; run `{self.launcher.usage()} --backend "
                              "deepspeed ...`")
        if self.device_request != "auto":
            # DeepSpeed picks its accelerator at import; this makes it the one asked for.
            os.environ["DS_ACCELERATOR"] = self.device_request
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator
        except ImportError as exc:
            raise BackendUnavailableError(f"deepspeed does not import ({exc}); {INSTALL_HINT}") from None
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.ds = deepspeed
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        accel = get_accelerator().device_name()
        self._device = self._pick_device(self._local_rank) if accel == "cuda" else torch.device("cpu")
        deepspeed.init_distributed(dist_backend=self._dist_backend(), verbose=False,
                                   timeout=_dt.timedelta(seconds=self.timeout_s))
        self._read_world("LOCAL_SIZE")  # the deepspeed launcher's name for it
        if self.math_changes:
            warn(f"deepspeed: the config sets {', '.join(self.math_changes)}; the update now differs from "
                 "what one process (and the other backends) compute")

    def _shutdown(self, *, failed: bool) -> None:
        if not failed:
            self.barrier()  # every rank is done with the buffers
        remove_shm_buffers(os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR"), self.rank)
        super()._shutdown(failed=failed)

    # ------------------------------------------------------------ the engine
    def _wrap_model(self, model: nn.Module) -> nn.Module:
        """A :class:`DeepSpeedModel`; its engine is built by ``wrap_optimizer``
        (or, for evaluation only, by the first forward)."""
        if isinstance(model, DeepSpeedModel):
            raise ParallelxError("deepspeed: this model is already wrapped")
        wrapped = DeepSpeedModel(self, model)
        self._models.append(wrapped)
        return wrapped

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, DeepSpeedOptimizer):
            raise ParallelxError("deepspeed: this optimizer is already wrapped")
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self._models if wanted <= {id(p) for p in m.module.parameters()}]
        if not owners:
            raise ParallelxError("deepspeed: this optimizer's parameters belong to no model passed to wrap_model; "
                                 "call `model = backend.wrap_model(model)` first, and build the optimizer on "
                                 "model.parameters()")
        owner = owners[-1]
        if owner.engine is not None:
            raise ParallelxError("deepspeed: the model's engine was already built without an optimizer (a forward "
                                 "ran before wrap_optimizer, or it was wrapped twice); call wrap_optimizer right "
                                 "after wrap_model, or use backend.setup(model, optimizer)")
        return self._build(owner, optimizer)

    def _build(self, wrapped: DeepSpeedModel, optimizer: torch.optim.Optimizer | None) -> DeepSpeedOptimizer | None:
        engine, ds_optimizer, _, _ = self.ds.initialize(model=wrapped.module, optimizer=optimizer, config=self.config)
        object.__setattr__(wrapped, "engine", engine)
        object.__setattr__(wrapped, "trains", optimizer is not None)
        engine.train(wrapped.training)
        return DeepSpeedOptimizer(engine, ds_optimizer) if optimizer is not None else None

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None = None) -> None:
        self._engine_for(loss, model).backward(loss)

    def _engine_for(self, loss: torch.Tensor, model: nn.Module | None) -> Any:
        """The engine whose backward ``loss`` needs: the named model's, the only
        trained one's, or the one whose parameters the loss depends on."""
        if model is not None:
            for m in self._models:
                if model is m or model is m.engine or model is m.module:
                    if not m.trains:
                        raise ParallelxError("deepspeed: backward(loss, model=...) names a model without an "
                                             "optimizer; call backend.wrap_optimizer(optimizer) for it first")
                    return m.engine
            raise ParallelxError("deepspeed: backward(loss, model=...) names a model not set up by this backend")
        trained = [m for m in self._models if m.trains]
        if len(trained) == 1:
            return trained[0].engine
        if not trained:
            raise ParallelxError("deepspeed: no model has an optimizer yet; call "
                                 "`optimizer = backend.wrap_optimizer(optimizer)` (or backend.setup(model, "
                                 "optimizer)) before backend.backward(loss)")
        used = _graph_parameters(loss)
        hits = [m for m in trained if any(id(p) in used for p in m.module.parameters())]
        if len(hits) == 1:
            return hits[0].engine
        raise ParallelxError(f"deepspeed: {len(trained)} models are set up and this loss depends on {len(hits)} "
                             "of them; say which one it trains: backend.backward(loss, model=model)")

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DeepSpeedModel) else super().unwrap(model)

    # ------------------------------------------------------------ checkpoints
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


def _read_config(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return json.loads(json.dumps(config))
    path = Path(config)
    if not path.is_file():
        raise ParallelxError(f"deepspeed: config file {path} does not exist")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ParallelxError(f"deepspeed: config file {path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ParallelxError(f"deepspeed: config file {path} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _math_changes(user: Mapping[str, Any]) -> list[str]:
    """The entries of a user's config that make the update differ from plain PyTorch."""
    changes = [f"{k}={user[k]!r}" for k, plain in PLAIN_MATH.items() if k in user and user[k] != plain]
    changes += [f"{k}.enabled=true" for k in _MATH_SECTIONS
                if isinstance(user.get(k), Mapping) and user[k].get("enabled") not in (None, False)]
    if user.get("communication_data_type") not in (None, "fp32"):
        changes.append(f"communication_data_type={user['communication_data_type']!r}")
    if user.get("gradient_accumulation_steps", 1) != 1:
        changes.append(f"gradient_accumulation_steps={user['gradient_accumulation_steps']!r}")
    if "scheduler" in user:
        changes.append("a scheduler (stepped inside optimizer.step())")
    return changes


def _graph_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) that ``loss``'s autograd graph reaches."""
    found: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None:
            found.add(id(var))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found
