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

Checkpoints hold the ZeRO 1-3 optimizer state whole, in ``torch.optim``'s
layout, whatever the stage and world size: ``_deepspeed_zero`` gathers and
scatters it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx.backends import _deepspeed_zero as zero_state
from parallelx.errors import BackendUnavailableError, ParallelxError
from parallelx.launch import Launcher
from parallelx.log import warn
from parallelx.loop import LoopOptions
from parallelx.precision import EnginePrecision, Precision
from parallelx.process_group import ProcessGroupBackend
from parallelx.state import keep_rng_state

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
        with self._backend._watch("forward (ZeRO-3 gathers parameters in it)"):
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
    def __init__(self, engine: Any, optimizer: Any, params: list[nn.Parameter] | None = None) -> None:
        self.engine = engine
        self.optimizer = optimizer
        #: The trained parameters in the user's groups' order (ZeRO replaces
        #: them in ``param_groups`` by its flat partitions): the order in which
        #: the clipping norm adds them up, as torch's does.
        self.trained_params: list[nn.Parameter] = list(params or [])
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
        for hook in list(self._optimizer_step_post_hooks.values()):  # torch.optim's step hooks (parallelx.buffers)
            hook(self, (), {})

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
    # Its own launcher, torchrun (which restarts failed jobs; the deepspeed launcher does not), plain variables.
    environments = ("deepspeed", "torchrun", "env")
    requires_module = "deepspeed"
    # DeepSpeed's CPU all-reduce polls shared memory with no timeout.
    needs_watchdog = True
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
        self.options = _adopt_config(self.options, user, gradient_accumulation_steps)
        self._config_inputs = (user, zero_stage, micro_batch_size)
        self.config = self._build_config(user, zero_stage, micro_batch_size, self.options)
        self._models: list[DeepSpeedModel] = []
        self._warn_rounding()

    @staticmethod
    def _build_config(user: dict[str, Any], zero_stage: int | None, micro_batch_size: int | None,
                      options: LoopOptions) -> dict[str, Any]:
        cfg = json.loads(json.dumps(user))  # a deep copy we may edit
        if micro_batch_size is not None:
            cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
            cfg.pop("train_batch_size", None)  # recomputed by DeepSpeed from micro x gas x world
        # Only DeepSpeed's bookkeeping reads it: parallelx marks the windows'
        # boundaries itself and divides the loss once (Backend.backward).
        cfg["gradient_accumulation_steps"] = options.accumulate
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
        if options.precision == "16-mixed":
            # DeepSpeed's own float16 engine: fp32 master weights, its dynamic loss scaler.
            fp16 = cfg.setdefault("fp16", {})
            fp16["enabled"] = True
            fp16.setdefault("loss_scale", 0)
        # parallelx clips the averaged gradients as torch does (whole under ZeRO 0,
        # each rank's share under ZeRO 1-3: _clip_gradients); only where the
        # engine keeps copies that parallelx does not see does the engine clip,
        # with its own arithmetic.
        cfg["gradient_clipping"] = (options.clip_grad_norm or 0.0) if _engine_clips(cfg) else 0.0
        if options.wire_dtype is not None:
            cfg["communication_data_type"] = options.grad_compression
        # Plain torch optimizers (SGD) are what the recipes use; ZeRO runs them fine.
        cfg.setdefault("zero_allow_untested_optimizer", True)
        cfg.setdefault("steps_per_print", 2**31 - 1)
        return cfg

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("deepspeed")
        # The helps say what None means; they end in parallelx.cli.NONE_IN_WORDS (a
        # "%(default).0s" that renders as nothing) so that no formatter adds "(default: None)".
        group.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None,
                           help="ZeRO stage (default: the config file's, else 0)%(default).0s")
        group.add_argument("--deepspeed-config", default=None, metavar="JSON",
                           help="a DeepSpeed config file; explicit options override it (default: none, the "
                                "options alone)%(default).0s")
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

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"zero_stage": self.zero_stage}

    def _init(self) -> None:
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
        assert self.environment is not None
        self._local_rank = self.environment.world().local_rank
        accel = get_accelerator().device_name()
        self._device = self._pick_device(self._local_rank) if accel == "cuda" else torch.device("cpu")
        self._init_process_group()  # parallelx's join (a store per torchrun restart); DeepSpeed then adopts it
        deepspeed.init_distributed(dist_backend=self._dist_backend(), verbose=False,
                                   timeout=_dt.timedelta(seconds=self.timeout_s))
        self._read_world()
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
        # Taken before ZeRO swaps the groups' parameters for its flat partitions.
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad] if optimizer else []
        engine, ds_optimizer, _, _ = self.ds.initialize(model=wrapped.module, optimizer=optimizer, config=self.config)
        object.__setattr__(wrapped, "engine", engine)
        object.__setattr__(wrapped, "trains", optimizer is not None)
        engine.train(wrapped.training)
        return DeepSpeedOptimizer(engine, ds_optimizer, params) if optimizer is not None else None

    # ------------------------------------------------------ the training loop
    def _options_changed(self) -> None:
        self.config = self._build_config(*self._config_inputs, self.options)
        self._warn_rounding()

    def _warn_rounding(self) -> None:
        # ZeRO 2 and 3 keep a shard of the gradients only, so they reduce each
        # micro-batch's gradients as they are computed (DeepSpeed's no_sync
        # refuses to run under them).  In float32 that only reorders additions;
        # on a low-precision wire every micro-batch is rounded on its own.
        o = self.options
        if self.zero_stage >= 2 and o.accumulate > 1 and o.grad_compression != "none":
            warn(f"deepspeed: ZeRO stage {self.zero_stage} sends every micro-batch's gradients, so with "
                 f"--accumulate {o.accumulate} and --grad-compression {o.grad_compression} each is rounded to "
                 f"{o.grad_compression} separately; the update differs from the other backends (which round the "
                 "window's sum once) by that rounding")

    def _make_precision(self) -> Precision:
        # 16-mixed runs DeepSpeed's float16 engine, which scales the loss itself.
        return EnginePrecision(self.options.precision, self.device if self.initialized else None)

    def _backward(self, loss: torch.Tensor, *, model: nn.Module | None, boundary: bool) -> None:
        engine = self._engine_for(loss, model)
        # parallelx marks the boundary (a shorter last window included) and has
        # already divided the loss by the window's length: DeepSpeed must not again.
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss, scale_wrt_gas=False)

    def _clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        if _engine_clips(self.config):
            return None  # the engine clips inside its step (gradient_clipping in the config)
        if self.zero_stage == 0:
            return super()._clip_gradients(optimizer, max_norm)
        # ZeRO 1-3: the engine's own clipping takes the norm in float64 and
        # divides by (norm + 1e-6) / max_norm; one process (and ddp, horovod,
        # ZeRO 0) takes it in the gradients' float32 and multiplies by
        # max_norm / (norm + 1e-6).  Those differ in the last bits at every
        # clipped step, and a network with kinks (ReLU, max-pool) can grow that
        # into percents over a run.  So parallelx clips here too, with torch's
        # arithmetic, on each rank's share of the averaged gradients, and
        # reports that norm (clipping or not) on every rank.  When it clips,
        # the norm is torch's to the bit (split parameters are put together),
        # since it then scales the update.
        slices = zero_state.reduced_gradients(optimizer.optimizer, self.zero_stage)  # type: ignore[attr-defined]
        norm = zero_state.global_grad_norm(slices, optimizer.trained_params,  # type: ignore[attr-defined]
                                           lambda t: self.all_reduce(t, "sum"), exact=max_norm is not None)
        if max_norm is not None:
            zero_state.clip_(slices, max_norm, norm)
        return norm

    def _apply_step(self, optimizer: torch.optim.Optimizer) -> bool:
        engine = optimizer.engine  # type: ignore[attr-defined]
        before = engine.skipped_steps
        optimizer.step()
        return bool(engine.skipped_steps > before)  # float16 overflow: skipped on every rank together

    def _stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        norm = optimizer.engine.get_global_grad_norm()  # type: ignore[attr-defined]
        return torch.tensor(float("nan") if norm is None else float(norm))

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
        # Gathered from the shards (a collective), in the layout torch.optim itself uses.
        return zero_state.gather_indexed(optimizer.optimizer, self.zero_stage,
                                         zero_state.param_names(optimizer.engine.module))

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        if self.zero_stage == 0:
            named = super().named_optimizer_state(model, optimizer)
        else:
            named = zero_state.gather_named(optimizer.optimizer, self.zero_stage,
                                            zero_state.param_names(self.unwrap(model)))
        # The engine's own step counters ride along; a plain optimizer ignores them.
        engine = optimizer.engine
        named["engine_counters"] = {k: int(getattr(engine, k)) for k in _ENGINE_COUNTERS}
        # So does the fp16 engine's running loss scale (16-mixed): the other
        # backends' GradScaler is saved beside the optimizer, DeepSpeed's lives in it.
        scale = zero_state.loss_scale_state(optimizer.optimizer)
        if scale is not None:
            named["loss_scale"] = scale
        return named

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        if self.zero_stage == 0:
            super().load_named_optimizer_state(model, optimizer, state)
        else:
            zero_state.scatter_named(optimizer.optimizer, self.zero_stage,
                                     zero_state.param_names(self.unwrap(model)), state)
        counters = state.get("engine_counters")
        if counters is not None:
            for k in _ENGINE_COUNTERS:
                setattr(optimizer.engine, k, int(counters[k]))
        zero_state.load_loss_scale_state(optimizer.optimizer, state.get("loss_scale"))

    def load_state_dict(self, target: nn.Module | Any, state: Mapping[str, Any]) -> None:
        if isinstance(target, nn.Module):
            module = self.unwrap(target)
            if self.zero_stage == 3:
                # Checked on every rank first: a mismatch raised on rank 0 alone
                # would leave the others waiting in the gather.
                zero_state.check_shapes(module, state)
                # Rank 0 loads the full tensors; DeepSpeed re-partitions them on exit.
                with self.ds.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                    if self.is_main():
                        module.load_state_dict(state)
                # Only the parameters are re-partitioned from rank 0: every rank
                # loads the buffers (BatchNorm's statistics) itself.
                with torch.no_grad():
                    for name, buf in module.named_buffers():
                        if name in state:
                            buf.copy_(state[name])
            else:
                module.load_state_dict(state)
            if self.zero_stage >= 1 and isinstance(target, DeepSpeedModel) and target.trains:
                # ZeRO steps its fp32 master copies and copies them back into the
                # weights: the masters must hold the loaded values too.
                zero_state.set_fp32_masters(module, state)
        elif self.zero_stage == 0:
            target.load_state_dict(state)
        else:
            # A plain torch.optim state (as optimizer_state_dict gives): positions, in group order.
            zero_state.scatter_indexed(target.optimizer, self.zero_stage,
                                       zero_state.param_names(target.engine.module), state)


#: DeepSpeed engine counters that a training-state checkpoint restores.
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


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


def _engine_clips(cfg: Mapping[str, Any]) -> bool:
    """True when the engine, not parallelx, must clip: its fp16/bf16 engines
    keep (loss-scaled) copies of the gradients, and ZeRO with the optimizer
    offloaded moves them to the CPU during the backward; parallelx sees
    neither before the step."""
    casts = any(isinstance(cfg.get(k), Mapping) and bool(cfg[k].get("enabled")) for k in ("fp16", "bf16"))
    zero = cfg["zero_optimization"]
    offload = zero.get("offload_optimizer")
    offloaded = isinstance(offload, Mapping) and offload.get("device") not in (None, "none")
    return casts or (zero["stage"] >= 1 and offloaded)


def _adopt_config(options: LoopOptions, user: Mapping[str, Any], gas: int | None) -> LoopOptions:
    """Loop options completed from a user's config: its accumulation steps and
    clipping become the options the loop applies on this backend (explicit
    options win), so a config file still means what it says."""
    changes: dict[str, Any] = {}
    if gas is not None:
        changes["accumulate"] = gas
    elif options.accumulate == 1 and user.get("gradient_accumulation_steps", 1) not in (1, "auto"):
        changes["accumulate"] = int(user["gradient_accumulation_steps"])
    clip = user.get("gradient_clipping")
    if options.clip_grad_norm is None and isinstance(clip, (int, float)) and clip > 0:
        changes["clip_grad_norm"] = float(clip)
    return dataclasses.replace(options, **changes) if changes else options


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
