"""``deepspeed``: DeepSpeed's engine, ZeRO stages 0 to 3.

    deepspeed --num_gpus 2 recipes/cifar10.py --backend deepspeed --zero-stage 2

DeepSpeed builds its engine from the model and the optimizer together.
``wrap_model`` returns a :class:`DeepSpeedModel` whose engine is built when the
optimizer arrives (``wrap_optimizer``), under ZeRO-3 at the first call that
needs it (the optimizer waits: set-up then holds the parameters' partitions
only), or at the first forward when there is no optimizer;
``setup(model, optimizer)`` does both at once.  The optimizer returned is
a :class:`DeepSpeedOptimizer`, a ``torch.optim.Optimizer`` whose ``step()`` and
``zero_grad()`` are the engine's, so LR schedulers and the plain loop
(``backend.backward(loss); optimizer.step(); optimizer.zero_grad()``) work.

The config comes from the constructor (``micro_batch_size``, ``zero_stage``)
or from a user's JSON file or dict (``config="ds_config.json"``, ``config={...}``);
options given explicitly override it.  DeepSpeed's own defaults that change the update
are turned off unless the config sets them (``_deepspeed_config.PLAIN_MATH``); a config
that does set one is honoured.  Its ``optimizer`` and ``scheduler`` sections are
refused at construction (the script's torch optimizer and scheduler are the ones
stepped, on every backend); one start-up line on rank 0 says what the run adopts
from the rest, keeps for the engine and overrides, a warning where that changes
the update.  Without a GPU DeepSpeed picks its CPU accelerator and communicates over Gloo.

Private helpers beside it: ``_deepspeed_config`` builds the config,
``_deepspeed_engine`` holds the model and optimizer adapters, and
``_deepspeed_zero`` gathers and scatters the ZeRO 1-3 optimizer state (whole,
in ``torch.optim``'s layout, whatever the stage and world size) and clips the
ZeRO 1-3 gradients as torch does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from parallelx.bigmodels.estimate import ModelCounts, RankMemory, Training
from parallelx.bigmodels.export import Layout
from parallelx.cli import SameInScripts
from parallelx.errors import BackendUnavailableError, ParallelxError
from parallelx.launching.launchers import Launcher
from parallelx.log import info, warn
from parallelx.parts.collectives import Collectives
from parallelx.parts.gradsync import (
    GradientSync,
    Models,
    clip_to_norm,
    model_order,
    optimizer_params,
    owner_names,
    summed_per_parameter,
)
from parallelx.parts.lockstep import ForwardLockstep
from parallelx.parts.loop import LoopOptions
from parallelx.parts.mesh import Mesh
from parallelx.parts.precision import EnginePrecision, Precision
from parallelx.parts.shards import ParameterShards
from parallelx.parts.state import (
    indexed_optimizer_state,
    load_named_optimizer_state,
    named_from_indexed,
    named_optimizer_state,
)
from parallelx.parts.stateio import StateIO, Unwrap, keyed_like, map_tensors, named_parameters
from parallelx.storage import Location
from parallelx.strategies.process_group import ProcessGroupStrategy
from parallelx.strategy import BackendSpec, Joined, Run, unwrap

from . import _chunks as chunks
from . import _deepspeed_shards as zero_shards
from . import _deepspeed_zero as zero_state
from ._allocator import after_first_step, return_freed_memory
from ._deepspeed_config import (  # noqa: F401
    PLAIN_MATH,
    adopt_config,
    build_config,
    config_line,
    engine_clips,
    math_changes,
    model_sizes,
    read_config,
    refuse_engine_sections,
    with_sizes,
    zero_memory,
)
from ._deepspeed_engine import DeepSpeedModel, DeepSpeedOptimizer, graph_parameters
from ._moe import ExpertLayout, check_groups, check_stage, expert_layers, expert_norm
from ._shards import ZeroShards

INSTALL_HINT = "pip install 'deepspeed==0.19.8' (or pip install 'parallelx[deepspeed]')"


def remove_shm_buffers(port: str | int | None, addr: str | None = "*", rank: int | str = "*") -> None:
    """Delete DeepSpeed's CPU all-reduce buffers of one launch (its master
    port), optionally of one address and rank.  Each rank maps a 69 MB file
    into /dev/shm (RAM), named by master address, port and rank, and DeepSpeed
    never removes it: every launch on a new port would leak one per rank, and
    a crashed or killed rank cannot clean up after itself."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{addr}_{port}_{rank}"):
        path.unlink(missing_ok=True)  # mappings stay valid until the process exits


def import_deepspeed() -> Any:
    """``import deepspeed``, without the MLflow import it makes at start-up.

    DeepSpeed's autotuner imports ``mlflow`` when it is installed (with pandas:
    about 3 s of CPU per process), for the autotuning runs of its own launcher,
    which never happen inside a training process.  It sees no MLflow while it
    loads; afterwards ``import mlflow`` works as before (parallelx's tracker,
    the script's own)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # ImportError for this one import
    try:
        import deepspeed
    finally:
        del sys.modules["mlflow"]
    return deepspeed


def extensions_dir() -> Path:
    """Where this environment keeps DeepSpeed's JIT-built ops: beside its packages."""
    return Path(sys.prefix) / "torch_extensions"


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


class MeshUnit:
    """DeepSpeed's model-parallel unit (``mpu``) over parallelx's mesh: ZeRO partitions and averages
    over the data-parallel ranks, its checkpoints and clipping know the tensor-parallel ones."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def get_model_parallel_rank(self) -> int:
        return self.mesh.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.tp_size

    def get_model_parallel_group(self) -> Any:
        return self.mesh.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return torch.distributed.get_global_rank(self.mesh.tp_group, 0)

    def get_data_parallel_rank(self) -> int:
        return self.mesh.data_rank

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.data_size

    def get_data_parallel_group(self) -> Any:
        return self.mesh.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return torch.distributed.get_process_group_ranks(self.mesh.dp_group)


class DeepSpeedStrategy(ProcessGroupStrategy):
    spec = BackendSpec(
        name="deepspeed",
        summary="`deepspeed.initialize`, ZeRO stages 0-3 (`--zero-stage`); no clipping unless the config asks",
        launcher=DEEPSPEED,
        # Its own launcher, torchrun (which restarts failed jobs; the deepspeed launcher does not), Ray Train,
        # srun's tasks, plain variables.
        environments=("ray", "deepspeed", "torchrun", "slurm", "env"),
        requires_module="deepspeed",
        # DeepSpeed's CPU all-reduce polls shared memory with no timeout.
        needs_watchdog=True,
        offloads=True,
        # ZeRO 0-2 over the data-parallel ranks, DeepSpeed told the groups through its model-parallel unit.
        tensor_parallel=True,
        install_hint=INSTALL_HINT,
        probe_code=(
            "import deepspeed; from deepspeed.accelerator import get_accelerator; "
            "print('deepspeed', deepspeed.__version__, 'accelerator=' + get_accelerator().device_name())"
        ),
    )
    # 16-mixed runs DeepSpeed's float16 engine, which scales the loss itself.
    precision_class = EnginePrecision

    def __init__(
        self,
        *,
        zero_stage: int | None = None,
        micro_batch_size: int | None = None,
        config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
        gradient_accumulation_steps: int | None = None,
        sharded_checkpoints: bool = False,
    ) -> None:
        if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
            raise ParallelxError(f"deepspeed: zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ParallelxError(f"deepspeed: micro_batch_size must be >= 1, got {micro_batch_size}")
        if gradient_accumulation_steps is not None and gradient_accumulation_steps < 1:
            raise ParallelxError(
                f"deepspeed: gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
            )
        self.user = read_config(config)
        # Refused before anything is built, on every rank alike: parallelx never builds an optimizer or
        # a scheduler from a config (on any backend), and beside the script's they change its math.
        refuse_engine_sections(self.user)
        #: The user's config as given (``user`` gains --cpu-offload's entries), for the start-up line.
        self.given = read_config(self.user)
        #: The start-up line saying what the run takes from the config, and whether it is a warning.
        self.config_line: tuple[str, bool] | None = None
        self.zero_stage_asked, self.micro_batch_size = zero_stage, micro_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        #: Training-state checkpoints as each rank's own partitions (ZeRO 1-3), none gathered.
        self.sharded_checkpoints = bool(sharded_checkpoints)
        self.wrapped: list[DeepSpeedModel] = []
        self.lockstep: ForwardLockstep | None = None
        self.config: dict[str, Any] = {}
        self.sync: DeepSpeedSync | None = None

    def configure(self, options: LoopOptions) -> LoopOptions:
        """The user's config file adopted into the loop options (its accumulation, clipping, precision),
        then the engine's config built from both."""
        if options.compute_dtype is not None:
            # DeepSpeed's bf16 engine runs at ZeRO 0-3 here, but it keeps the float32 masters inside its
            # optimizer's partitions and the module holds the bfloat16 copies: the model state parallelx
            # saves and loads (portable files, training state) would be the copies, a silent rounding.
            raise ParallelxError(
                "deepspeed: --precision bf16-compute is not offered: DeepSpeed's bf16 engine holds the float32 "
                "weights inside ZeRO's optimizer and the model only as bfloat16 copies, which checkpoints would "
                "save; use the fsdp backend with --precision bf16-compute (its gathers in bfloat16, the float32 "
                "shards saved), or --precision bf16-mixed (autocast) here"
            )
        user = self.user
        if not self.config:  # the first time: the config file's own values become the run's options
            if self.run.cpu_offload:
                if (self.zero_stage_asked or 0) < 1 and int(user.get("zero_optimization", {}).get("stage", 0)) < 1:
                    raise ParallelxError(
                        "deepspeed: --cpu-offload moves ZeRO's optimizer state: give --zero-stage 1 to 3"
                    )
                # The optimizer's state and step on the CPU, with the user's torch optimizer (not DeepSpeed's
                # own CPU Adam, which would change the math).
                zero = user.setdefault("zero_optimization", {})
                zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": True})
                user.setdefault("zero_force_ds_cpu_optimizer", False)
            self.math_changes = math_changes(user)
            asked, options = options, adopt_config(options, user, self.gradient_accumulation_steps)
        first = not self.config
        self.config = build_config(user, self.zero_stage_asked, self.micro_batch_size, options)
        if first:
            if self.given:
                self.config_line = config_line(
                    self.given,
                    self.config,
                    asked,
                    options,
                    zero_stage=self.zero_stage_asked,
                    micro_batch_size=self.micro_batch_size,
                )
            self.warn_rounding(options)
        return options

    def state_io(self) -> StateIO:
        return DeepSpeedStateIO(unwrap, self.zero_stage, self.wrapped, self.sharded_checkpoints)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("deepspeed")
        # The helps say what None means; they end in parallelx.cli.NONE_IN_WORDS (a
        # "%(default).0s" that renders as nothing) so that no formatter adds "(default: None)".
        group.add_argument(
            "--zero-stage",
            type=int,
            choices=(0, 1, 2, 3),
            default=None,
            help="ZeRO stage (default: the config file's, else 0)%(default).0s",
        )
        group.add_argument(
            "--deepspeed-config",
            "--deepspeed_config",
            # A script that ran deepspeed.add_config_arguments(parser) has --deepspeed_config: its value is this one.
            action=SameInScripts,
            default=None,
            metavar="JSON",
            help="a DeepSpeed config file (or dict in code: config=); explicit options override it, its optimizer "
            "and scheduler sections are refused (docs/from-deepspeed.md) (default: none, the options alone)"
            "%(default).0s",
        )
        group.add_argument(
            "--zero-sharded-checkpoints",
            action="store_true",
            help="training-state checkpoints as each rank's own ZeRO 1-3 partitions (torch.distributed.checkpoint "
            "shards, loadable by every backend at any world size), nothing gathered",
        )
        # DeepSpeed's launch lines pass --deepspeed (its flag that a config follows; no effect on its engine).
        # Without it argparse would read --deepspeed as an abbreviation of --deepspeed-config.
        group.add_argument("--deepspeed", action="store_const", const=True, default=False, help=argparse.SUPPRESS)
        # The deepspeed launcher appends --local_rank=N to the script's argv; the rank comes from the environment.
        group.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)

    @classmethod
    def options_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        options = super().options_from_args(args)
        options.update(
            zero_stage=getattr(args, "zero_stage", None),
            # --deepscale_config: DeepSpeed's former name, which add_config_arguments still adds.
            config=getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None),
            micro_batch_size=getattr(args, "batch_size", None),
            sharded_checkpoints=getattr(args, "zero_sharded_checkpoints", False),
        )
        return options

    @classmethod
    def ignored_elsewhere(cls, options: Mapping[str, Any]) -> list[str]:
        # Where deepspeed would adopt a config entry as a loop option, another backend must not drop it
        # without a word: the same script would clip (or accumulate) on one backend and not another.
        try:
            cfg = read_config(options.get("config"))
        except ParallelxError:
            return []  # said by the deepspeed backend where it runs
        said = []
        clip = cfg.get("gradient_clipping")
        if isinstance(clip, (int, float)) and clip > 0:
            said.append(
                f"the DeepSpeed config's gradient_clipping={clip} (deepspeed clips there): pass "
                f"clip_grad_norm={clip} (--clip-grad-norm {clip}) to clip on every backend"
            )
        gas = cfg.get("gradient_accumulation_steps")
        if isinstance(gas, int) and gas > 1:
            said.append(
                f"the DeepSpeed config's gradient_accumulation_steps={gas}: pass accumulate={gas} "
                f"(--accumulate {gas}) to accumulate on every backend"
            )
        for section, precision in (("fp16", "16-mixed"), ("bf16", "bf16-mixed")):
            entry = cfg.get(section)
            if isinstance(entry, Mapping) and entry.get("enabled"):
                said.append(
                    f"the DeepSpeed config's {section} section: pass precision={precision!r} "
                    f"(--precision {precision}) for a 16-bit forward on every backend"
                )
        return said

    @classmethod
    def estimate_memory(cls, model: ModelCounts, world_size: int, training: Training) -> list[RankMemory]:
        stages = (0, 1, 2) if training.tensor_parallel > 1 else (0, 1, 2, 3)  # ZeRO-3 takes no tensor parallelism
        return [zero_memory(stage, model, world_size, training) for stage in stages]

    @property
    def zero_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    def join(self) -> Joined:
        if self.run.device_request != "auto":
            # DeepSpeed picks its accelerator at import; this makes it the one asked for.
            os.environ["DS_ACCELERATOR"] = self.run.device_request
        # DeepSpeed JIT-builds its ops (the CPU communication op: minutes on 2 cores) under
        # TORCH_EXTENSIONS_DIR, by default ~/.cache: one place per environment instead, where
        # the set-up builds them once and every launch, with or without the Makefile, finds them.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
        # torch builds them with the first `ninja` on PATH, and two ninja versions (this environment's,
        # the system's) hash the same command differently: each would see the other's build as stale
        # and build again.  This environment's ninja, when it has one, always.
        own_bin = Path(sys.prefix) / "bin"
        if (own_bin / "ninja").is_file() and not os.environ.get("PATH", "").startswith(str(own_bin)):
            os.environ["PATH"] = f"{own_bin}{os.pathsep}{os.environ.get('PATH', '')}"
        try:
            deepspeed = import_deepspeed()
            from deepspeed.accelerator import get_accelerator
        except ImportError as exc:
            raise BackendUnavailableError(f"deepspeed does not import ({exc}); {INSTALL_HINT}") from None
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.ds = deepspeed
        local_rank = self.environment.world().local_rank
        accel = get_accelerator().device_name()
        device = self.run.pick_device(local_rank) if accel == "cuda" else torch.device("cpu")
        self.init_process_group(device)  # parallelx's join (a store per torchrun restart); DeepSpeed then adopts it
        deepspeed.init_distributed(
            dist_backend=self.dist_backend(device), verbose=False, timeout=_dt.timedelta(seconds=self.run.timeout_s)
        )
        joined = self.read_world(device)
        if self.zero_stage == 3:
            return_freed_memory(device)  # the gathered parameters' blocks, freed every step (_allocator)
            zero_state.share_float32_masters()
        self.sync = DeepSpeedSync(self.run.models, joined.comm, self.config, self.wrapped)
        if self.config_line is not None:  # one line, on rank 0 (parallelx.log)
            line, changes_the_update = self.config_line
            if changes_the_update:
                warn(line)
            else:
                info(f"parallelx: {line}")
        return joined

    def gradient_sync(self) -> GradientSync:
        assert self.sync is not None, "join() made it"
        return self.sync

    def bind(self, run: Run) -> LoopOptions:
        options = super().bind(run)  # the engine's config, its stage
        tp = run.tensor_parallel_size
        if tp > 1 and self.zero_stage == 3:
            raise ParallelxError(
                f"deepspeed: --tensor-parallel {tp} with ZeRO-3: DeepSpeed trains tensor parallelism with ZeRO 0, 1 "
                "and 2 only (ZeRO-3 partitions each layer's slices again, which its engine does not put together): "
                f"use --zero-stage 1 or 2, or --backend fsdp --tensor-parallel {tp} (2D: tensor parallel x FSDP2, "
                "sharded as ZeRO-3 shards)"
            )
        return options

    def shutdown(self, *, failed: bool) -> None:
        if not failed:
            self.run.comm.barrier()  # every rank is done with the buffers
        remove_shm_buffers(os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR"), self.run.world.rank)
        super().shutdown(failed=failed)

    # ------------------------------------------------------------ the engine
    def wrap_model(self, model: nn.Module) -> nn.Module:
        """A :class:`DeepSpeedModel`; its engine is built by ``wrap_optimizer``
        (or, for evaluation only, by the first forward)."""
        if isinstance(model, DeepSpeedModel):
            raise ParallelxError("deepspeed: this model is already wrapped")
        check_stage(model, self.zero_stage)
        lockstep = None
        if (
            self.zero_stage == 3 and self.run.world.world_size > 1
        ):  # ZeRO-3's forward gathers the parameters: a collective
            if self.lockstep is None:
                self.lockstep = ForwardLockstep("deepspeed ZeRO-3", self.run.world.rank, self.run.timeout_s)
            lockstep = self.lockstep
        wrapped = DeepSpeedModel(model, self.build, self.run.watch, lockstep)
        self.wrapped.append(wrapped)
        return wrapped

    def compile(self, wrapped: nn.Module) -> None:
        pass  # the engine compiles itself once it is built (build)

    def weight_pieces(self, model: nn.Module) -> Layout:
        if self.zero_stage == 3:  # each rank writes its partitions
            self.engine_of(model)  # an eagerly built model is partitioned by its engine
            return zero_state.weight_pieces(unwrap(model), self.run.world.rank)
        return super().weight_pieces(model)

    def materialize(self, model: nn.Module) -> None:
        if self.zero_stage == 3:  # partitioned module by module: no rank holds the model whole
            zero_state.materialize_partitioned(model, self.config, self.run.device, self.name)
        else:
            super().materialize(model)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, DeepSpeedOptimizer):
            raise ParallelxError("deepspeed: this optimizer is already wrapped")
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in self.wrapped if wanted <= {id(p) for p in m.module.parameters()}]
        if not owners:
            raise ParallelxError(
                "deepspeed: DeepSpeed builds one engine per model and optimizer, and this optimizer's "
                "parameters belong to several models; give each model its own optimizer"
            )
        owner = owners[-1]
        check_groups(owner.module, self.zero_stage, optimizer)
        if owner.built or owner.pending is not None:
            raise ParallelxError(
                "deepspeed: the model's engine was already built without an optimizer (a forward "
                "ran before wrap_optimizer), or it has one; call wrap_optimizer once, right "
                "after wrap_model, or use backend.setup(model, optimizer)"
            )
        # Taken before ZeRO swaps the groups' parameters for its flat partitions.
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if self.zero_stage == 3:
            after_first_step(optimizer)  # the allocator's steady threshold (_allocator)
            owner.defer(optimizer)  # built by the first call that needs the engine (DeepSpeedModel)
        else:
            owner.build_now(optimizer)
        return DeepSpeedOptimizer(owner, optimizer, params)

    def build(self, wrapped: DeepSpeedModel, optimizer: torch.optim.Optimizer | None) -> None:
        """Build ``wrapped``'s engine, with ``optimizer`` or for inference only (no optimizer)."""
        scalars = [n for n, p in wrapped.module.named_parameters() if p.dim() == 0]
        if scalars:
            # DeepSpeed broadcasts every parameter viewed as bytes (`p.data.view(torch.uint8)`, in the
            # engine and in ZeRO-3's partitioning), which a 0-dim tensor cannot be: it raises inside.
            raise ParallelxError(
                f"deepspeed: DeepSpeed cannot set up 0-dim parameters ({', '.join(scalars[:3])}); make each a "
                "1-element tensor, e.g. nn.Parameter(torch.ones(1)) instead of nn.Parameter(torch.tensor(1.0))"
            )
        # ZeRO's buckets sized for this model where the user's config leaves them (DeepSpeed's own are
        # fixed, 5e8 elements whatever the model: more than the whole of a 200 M-parameter model).
        config = with_sizes(self.config, *model_sizes(wrapped.module))
        if optimizer is None and self.zero_stage in (1, 2):
            # ZeRO 1 and 2 partition an optimizer's state and gradients, and DeepSpeed refuses to build
            # them without one ("zero stage 1 requires an optimizer"); a model that is only run (a frozen
            # teacher, an evaluation copy) has neither, and its stage-0 engine holds the same whole weights.
            config = {**config, "zero_optimization": {"stage": 0}}
        mesh = self.run.mesh
        mpu = MeshUnit(mesh) if mesh is not None and mesh.tensor_parallel else None
        if mpu is None:
            self.ds.utils.groups.mpu = None  # an earlier engine's groups in this process are not this one's
        elif expert_layers(wrapped.module):
            raise ParallelxError(
                "deepspeed: --tensor-parallel with DeepSpeed's MoE layer is not offered: its expert groups are "
                "made over the whole world; leave --tensor-parallel out"
            )
        engine, ds_optimizer, _, _ = self.ds.initialize(
            model=wrapped.module, optimizer=optimizer, config=config, mpu=mpu
        )
        if self.run.compile_options.enabled:
            engine.compile(compile_kwargs=self.run.compile_options.kwargs)
        object.__setattr__(wrapped, "_engine", engine)
        object.__setattr__(wrapped, "ds_optimizer", ds_optimizer)
        object.__setattr__(wrapped, "trains", optimizer is not None)
        engine.train(wrapped.training)

    def engine_of(self, model: nn.Module) -> None:
        """Build the engine of ``model`` (wrapped or not) if its optimizer waits for it."""
        owner = wrapper_of(self.wrapped, model)
        if owner is not None:
            owner.engine  # noqa: B018

    def parameter_shards(self, model: nn.Module) -> ParameterShards:
        if any(self.config.get(kind, {}).get("enabled") for kind in ("fp16", "bf16")):
            # The engine's weights are then its 16-bit copies (the fp32 masters live inside ZeRO's
            # optimizer, partitioned differently at each stage): an average of them is not the
            # average one process keeps of its fp32 weights.
            raise ParallelxError(
                "deepspeed: a weight average (parallelx.EMA) beside DeepSpeed's 16-bit engine (--precision "
                "16-mixed, or fp16/bf16 in the config) would average its 16-bit copies of the weights, not the "
                "fp32 weights the other backends average; use --precision 32 or bf16-mixed (autocast), or fsdp"
            )
        module = unwrap(model)
        if self.zero_stage != 3:
            return ParameterShards(module)
        self.engine_of(model)
        if not all(hasattr(p, "ds_tensor") for p in module.parameters()):
            raise ParallelxError(
                "deepspeed: the model's ZeRO-3 engine is not built yet; make the weight average after "
                "backend.setup(model, optimizer) (or after the first forward of a model without one)"
            )
        return ZeroShards(module)

    # ------------------------------------------------------ the training loop
    def options_changed(self, options: LoopOptions) -> None:
        if self.sync is not None:
            self.sync.config = self.config
        self.warn_rounding(options)

    def warn_rounding(self, options: LoopOptions) -> None:
        # ZeRO 2 and 3 keep a shard of the gradients only, so they reduce each
        # micro-batch's gradients as they are computed (DeepSpeed's no_sync
        # refuses to run under them).  In float32 that only reorders additions;
        # on a low-precision wire every micro-batch is rounded on its own.
        o = options
        if self.zero_stage >= 2 and o.accumulate > 1 and o.grad_compression != "none":
            warn(
                f"deepspeed: ZeRO stage {self.zero_stage} sends every micro-batch's gradients, so with "
                f"--accumulate {o.accumulate} and --grad-compression {o.grad_compression} each is rounded to "
                f"{o.grad_compression} separately; the update differs from the other backends (which round the "
                "window's sum once) by that rounding"
            )


def wrapper_of(wrapped: list[DeepSpeedModel], model: nn.Module) -> DeepSpeedModel | None:
    """The wrapper of ``model``, given as the wrapper, the user's module or a built engine."""
    return next((m for m in wrapped if model is m or model is m.module or model is m._engine), None)


class DeepSpeedSync(GradientSync):
    """DeepSpeed's engine: its backward (with parallelx's accumulation
    boundary), its step, and ZeRO 1-3 gradients clipped as torch clips them."""

    def __init__(self, models: Models, comm: Collectives, config: dict[str, Any], wrapped: list[DeepSpeedModel]):
        super().__init__(models)
        self.comm = comm
        self.config = config
        self.wrapped = wrapped
        self.layouts: dict[int, ExpertLayout | None] = {}

    @property
    def zero_stage(self) -> int:
        return int(self.config["zero_optimization"]["stage"])

    def backward(self, loss: torch.Tensor, *, model: nn.Module | None, boundary: bool) -> None:
        engines = self.engines_for(loss, model)
        # Every backward accumulates (ZeRO 2 and 3 reduce-scatter into their partitions as they go);
        # the boundary's reduction runs in synchronize(), at step: a window's backward calls are not
        # counted ahead (several per micro-batch, losses through another model), and a backward at
        # the boundary would reduce once per call (ZeRO 1 and 2 then keep only the last call's).
        for engine in engines:
            engine.set_gradient_accumulation_boundary(False)
        first, others = engines[0], engines[1:]
        if others and self.config.get("fp16", {}).get("enabled"):
            # Each float16 engine scales its own loss; one loss cannot carry two engines' scales.
            raise ParallelxError(
                f"deepspeed: under 16-mixed this loss reaches {len(engines)} models' trained parameters, and "
                "each DeepSpeed engine scales the loss by its own factor; freeze the others for this backward "
                "(requires_grad_(False) on their parameters) or use precision 32 or bf16-mixed"
            )
        # The other engines this loss reaches run their backward hooks inside the first's backward
        # (DeepSpeed's torch-style backward, ZeRO 1-3).  ZeRO 0 has none and refuses a backward its
        # engine did not start: it is told this one is its own (nothing else runs off the boundary).
        marked = [e for e in others if not e._support_torch_style_backward]
        for engine in marked:
            engine._running_engine_backward_count += 1
            engine._running_engine_backward = True
        try:
            # The engine hooks its forward's outputs to divide their gradients by the accumulation steps
            # in a backward that is not its own, and tells its own by a hook on the tensor it is given,
            # which runs after the output's hook when that tensor *is* an output (a model that returns
            # its loss, in a window of one micro-batch): the loss then lost a factor of the window's
            # steps.  A new tensor (exactly equal) carries the engine's hook instead, which runs first.
            first.backward(loss * 1.0, scale_wrt_gas=False)
        finally:
            for engine in marked:
                engine._running_engine_backward_count -= 1
                engine._running_engine_backward = engine._running_engine_backward_count > 0

    def synchronize(self, optimizer: torch.optim.Optimizer) -> None:
        # The boundary's reduction (the plain loop's optimizer.step() runs it too).
        cast(DeepSpeedOptimizer, optimizer).finish_accumulation()

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        if engine_clips(self.config):
            return None  # the engine clips inside its step (gradient_clipping in the config)
        if self.zero_stage == 0:
            experts = self.experts(cast(DeepSpeedOptimizer, optimizer).model.module)
            if experts is None:
                return super().clip(optimizer, max_norm)
            # Each rank holds its own experts' gradients (DeepSpeed averages them in the expert groups):
            # a norm of the local ones alone would differ between the ranks, and so would the clipping.
            params = model_order(optimizer_params(optimizer), self.models())
            norm = expert_norm(params, experts, lambda t: self.comm.all_reduce(t, "sum"))
            if max_norm is not None:
                clip_to_norm(params, max_norm, norm)
            return norm
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
        ds = cast(DeepSpeedOptimizer, optimizer)
        slices = zero_state.reduced_gradients(ds.optimizer, self.zero_stage)
        params = model_order(ds.trained_params, self.models())
        tp = self.tensor_parallel
        if tp is not None:
            # ZeRO partitions over the data-parallel ranks: each parameter's norm as that group holds it
            # (a split layer's slice), then a split one's squares summed over the tensor-parallel group.
            data_comm = tp.mesh.data_comm
            per_param = zero_state.global_grad_norm(
                slices, params, lambda t: summed_per_parameter(data_comm, t), exact=False, per_parameter=True
            )
            norm = tp.combine_norms(per_param, params)
            if max_norm is not None:
                zero_state.clip_(slices, max_norm, norm)
            return norm
        experts = self.experts(ds.model.module)
        norm = zero_state.global_grad_norm(
            slices,
            params,
            lambda t: summed_per_parameter(self.comm, t),
            exact=max_norm is not None,
            # Experts of other ranks sit at the same positions: their squares add up, their slices must not.
            spread=set() if experts is None else set(experts.params),
        )
        if max_norm is not None:
            zero_state.clip_(slices, max_norm, norm)
        return norm

    def experts(self, module: nn.Module) -> ExpertLayout | None:
        """The layout of ``module``'s DeepSpeed MoE experts, made once (None: no MoE layer)."""
        if id(module) not in self.layouts:
            self.layouts[id(module)] = ExpertLayout(module) if expert_layers(module) else None
        return self.layouts[id(module)]

    def apply(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        engine = cast(DeepSpeedOptimizer, optimizer).engine
        before = engine.skipped_steps
        optimizer.step()
        return not engine.skipped_steps > before  # float16 overflow: skipped on every rank together

    def stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        norm = cast(DeepSpeedOptimizer, optimizer).engine.get_global_grad_norm()
        return torch.tensor(float("nan") if norm is None else float(norm))

    def averaged_gradients(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        if self.zero_stage == 0:
            return super().averaged_gradients(optimizer)
        ds = cast(DeepSpeedOptimizer, optimizer)
        names = owner_names(ds.trained_params, self.models())
        slices = zero_state.reduced_gradients(ds.optimizer, self.zero_stage)
        # ZeRO partitions over the data-parallel ranks: under tensor parallelism, those of this rank's group.
        tp = self.tensor_parallel
        comm = self.comm if tp is None else tp.mesh.data_comm
        whole = zero_state.whole_gradients(slices, ds.trained_params, lambda t: comm.all_reduce(t, "sum"))
        return self.named_whole([(names.get(id(p), f"param{i}"), p, g) for i, (p, g) in enumerate(whole)])

    def engines_for(self, loss: torch.Tensor, model: nn.Module | None) -> list[Any]:
        """The engines whose parameters ``loss`` reaches, the named model's first (it runs the
        backward); the only trained one's when its graph cannot be read."""
        trained = [m for m in self.wrapped if m.trains]
        named: DeepSpeedModel | None = None
        if model is not None:
            named = wrapper_of(self.wrapped, model)
            if named is None:
                raise ParallelxError("deepspeed: backward(loss, model=...) names a model not set up by this backend")
            if not named.trains:
                raise ParallelxError(
                    "deepspeed: backward(loss, model=...) names a model without an "
                    "optimizer; call backend.wrap_optimizer(optimizer) for it first"
                )
        if not trained:
            raise ParallelxError(
                "deepspeed: no model has an optimizer yet; call "
                "`optimizer = backend.wrap_optimizer(optimizer)` (or backend.setup(model, "
                "optimizer)) before backend.backward(loss)"
            )
        used = graph_parameters(loss)
        hits = [m for m in trained if any(id(p) in used for p in m.module.parameters())]
        if named is not None:
            hits = [named, *(m for m in hits if m is not named)]
        if not hits:
            if len(trained) == 1:
                return [trained[0].engine]
            raise ParallelxError(
                f"deepspeed: {len(trained)} models are set up and this loss reaches none of their "
                "trained parameters; say which one it trains: backend.backward(loss, model=model)"
            )
        return [m.engine for m in hits]


class DeepSpeedStateIO(StateIO):
    """Whole state from ZeRO's shards (a collective), in ``torch.optim``'s
    layout whatever the stage and world size, and scattered back into them."""

    def __init__(
        self, unwrap: Unwrap, zero_stage: int, wrapped: list[DeepSpeedModel], sharded_checkpoints: bool = False
    ) -> None:
        super().__init__(unwrap)
        self.zero_stage = zero_stage
        self.wrapped = wrapped
        self.sharded_checkpoints = sharded_checkpoints

    def sharded_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        module = self.unwrap(model)
        if not self.sharded_checkpoints or self.zero_stage == 0:
            return None
        if self.experts(module) is not None:
            warn("--zero-sharded-checkpoints: a model with DeepSpeed MoE layers is checkpointed whole (gathered)")
            return None
        found = zero_shards.sharded_state(optimizer.optimizer, self.zero_stage, module, zero_state.param_names(module))
        extra = self.named_optimizer_state_extras(optimizer)
        found["optimizer"].update(extra)
        return found

    def copy_shards(self, shards: Any, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        return map_tensors(shards, lambda t: chunks.copied(t, copy))

    def load_sharded_state(
        self, model: nn.Module, optimizer: Any, directory: Location, saved: Mapping[str, Any]
    ) -> bool:
        module = self.unwrap(model)
        if self.zero_stage == 0 or self.experts(module) is not None:
            return False  # the whole tensors, read from the shards
        names = zero_state.param_names(module)
        zero_shards.load_sharded_state(
            optimizer.optimizer, self.zero_stage, module, names, directory, list(saved["param_groups"])
        )
        self.load_named_optimizer_state_extras(optimizer, saved)
        return True

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"zero_stage": self.zero_stage}

    def whole_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        # Under ZeRO-3 the parameter's own tensor is this rank's partition (often empty).
        return zero_state.full_shape(param)

    @contextlib.contextmanager
    def gathered(self, module: nn.Module) -> Iterator[None]:
        """Under ZeRO-3 each rank holds a slice of every parameter: gather them
        (a collective) for the duration of the block."""
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                yield
        else:
            yield

    def experts(self, module: nn.Module) -> ExpertLayout | None:
        """The layout of ``module``'s DeepSpeed MoE experts (``_moe``), None without MoE layers."""
        return ExpertLayout(module) if expert_layers(module) else None

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with self.gathered(self.unwrap(model)):
            state = super().model_state_dict(model)
        experts = self.experts(self.unwrap(model))
        # Each rank holds its own experts under the same local keys: every expert, by its global index.
        return state if experts is None else experts.gather_model(state)

    def load_model_state_dict(self, model: nn.Module, state: Mapping[str, Any]) -> None:
        module = self.unwrap(model)
        experts = self.experts(module)
        if experts is not None:
            state = experts.local_model(state)
        state = keyed_like(state, module)
        if self.zero_stage == 3:
            import deepspeed

            # Checked on every rank first: a mismatch raised on rank 0 alone
            # would leave the others waiting in the gather.
            zero_state.check_shapes(module, state)
            # Every rank loads the full tensors into the gathered parameters; DeepSpeed re-partitions them on exit.
            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    module.load_state_dict(state)
            # Only the parameters are re-partitioned from rank 0: every rank
            # loads the buffers (BatchNorm's statistics) itself.
            with torch.no_grad():
                for name, buf in module.named_buffers():
                    if name in state:
                        buf.copy_(state[name])
        else:
            module.load_state_dict(state)
        if self.zero_stage >= 1 and isinstance(model, DeepSpeedModel) and model.trains:
            # ZeRO steps its fp32 master copies and copies them back into the
            # weights: the masters must hold the loaded values too.
            zero_state.set_fp32_masters(model.engine.optimizer, self.zero_stage, module, state)

    def optimizer_state_dict(self, optimizer: Any) -> dict[str, Any] | None:
        experts = self.experts(optimizer.engine.module)
        if experts is not None:  # positions in the whole model's groups (every expert), from the named state
            return indexed_optimizer_state(self.named_state(optimizer.engine.module, optimizer, experts))
        if self.zero_stage == 0:  # DeepSpeedOptimizer.state_dict is the plain optimizer's
            return super().optimizer_state_dict(optimizer)
        # Gathered from the shards (a collective), in the layout torch.optim itself uses.
        return zero_state.gather_indexed(
            optimizer.optimizer, self.zero_stage, zero_state.param_names(optimizer.engine.module)
        )

    def load_optimizer_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        module = optimizer.engine.module
        experts = self.experts(module)
        if experts is not None:
            groups = [experts.whole_order(g) for g in self.group_names(module, optimizer, experts)]
            self.load_named_state(module, optimizer, experts.local_optimizer(named_from_indexed(state, groups)))
        elif self.zero_stage == 0:
            optimizer.load_state_dict(state)
        else:
            # A plain torch.optim state (as optimizer_state_dict gives): positions, in group order.
            zero_state.scatter_indexed(
                optimizer.optimizer, self.zero_stage, zero_state.param_names(optimizer.engine.module), state
            )

    def names(self, module: nn.Module) -> dict[int, str]:
        """Each parameter's name in named optimizer states (ZeRO 1-3: as ``named_parameters`` gives it)."""
        return named_parameters(module) if self.zero_stage == 0 else zero_state.param_names(module)

    def group_names(self, module: nn.Module, optimizer: Any, experts: ExpertLayout) -> list[list[str]]:
        """Each of the optimizer's param groups as this rank's parameter names, experts by global index."""
        names = experts.global_names(self.names(module))
        if self.zero_stage == 0:
            return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        return [
            [names[id(p)] for p in params] for params in zero_state.trained_groups(optimizer.optimizer, self.zero_stage)
        ]

    def named_state(self, module: nn.Module, optimizer: Any, experts: ExpertLayout | None) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, whole: gathered from ZeRO's shards, and every
        rank's experts by their global index (collectives)."""
        names = self.names(module)
        if experts is not None:
            names = experts.global_names(names)
        if self.zero_stage == 0:
            named = named_optimizer_state(optimizer, names)
        else:
            named = zero_state.gather_named(optimizer.optimizer, self.zero_stage, names)
        return named if experts is None else experts.gather_optimizer(named)

    def load_named_state(self, module: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load a named state of this rank's parameters (experts under their local names)."""
        names = self.names(module)
        if self.zero_stage == 0:
            load_named_optimizer_state(optimizer, names, state)
        else:
            zero_state.scatter_named(optimizer.optimizer, self.zero_stage, names, state)

    def named_optimizer_state(self, model: nn.Module, optimizer: Any) -> dict[str, Any]:
        module = self.unwrap(model)
        named = self.named_state(module, optimizer, self.experts(module))
        named.update(self.named_optimizer_state_extras(optimizer))
        return named

    def named_optimizer_state_extras(self, optimizer: Any) -> dict[str, Any]:
        """What rides along with the optimizer's state, which a plain optimizer ignores: the engine's own
        step counters, and the fp16 engine's running loss scale (16-mixed: the other backends' GradScaler
        is saved beside the optimizer, DeepSpeed's lives in it)."""
        engine = optimizer.engine
        extras: dict[str, Any] = {"engine_counters": {k: int(getattr(engine, k)) for k in ENGINE_COUNTERS}}
        scale = zero_state.loss_scale_state(optimizer.optimizer)
        if scale is not None:
            extras["loss_scale"] = scale
        return extras

    def load_named_optimizer_state_extras(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        counters = state.get("engine_counters")
        if counters is not None:
            for k in ENGINE_COUNTERS:
                setattr(optimizer.engine, k, int(counters[k]))
        zero_state.load_loss_scale_state(optimizer.optimizer, state.get("loss_scale"))

    def load_named_optimizer_state(self, model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
        module = self.unwrap(model)
        experts = self.experts(module)
        self.load_named_state(module, optimizer, state if experts is None else experts.local_optimizer(state))
        self.load_named_optimizer_state_extras(optimizer, state)


#: DeepSpeed engine counters that a training-state checkpoint restores.
ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps")
