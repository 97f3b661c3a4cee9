"""The DeepSpeed config the ``deepspeed`` backend builds, for DeepSpeed's engine.

A user's config file (or dict) is read, completed by the constructor's
options (explicit ones win), and DeepSpeed's defaults that change the update
are set to the plain values unless the file sets them (:data:`PLAIN_MATH`).
Its ``optimizer`` and ``scheduler`` sections are refused (:func:`refuse_engine_sections`);
what the run adopts from the rest, keeps for the engine and overrides is one
line (:func:`config_line`), which names the entries that change the math.

Not a backend (the leading underscore): the registry names its modules
explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelx.bigmodels.estimate import ModelCounts, RankMemory, Training, layout, shard
from parallelx.errors import ParallelxError
from parallelx.parts.loop import LoopOptions
from parallelx.transforms.units import default_units

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


def build_config(
    user: dict[str, Any], zero_stage: int | None, micro_batch_size: int | None, options: LoopOptions
) -> dict[str, Any]:
    cfg = json.loads(json.dumps(user))  # a deep copy we may edit
    # The batch is the script's loader's: DeepSpeed's batch sizes are its bookkeeping only.  A
    # train_batch_size would be checked against micro x accumulation x world, and fail inside
    # DeepSpeed at a world size it does not divide: it is dropped (config_line says so).
    cfg.pop("train_batch_size", None)
    if micro_batch_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    # Only DeepSpeed's bookkeeping reads it: parallelx marks the windows'
    # boundaries itself and divides the loss once (Backend.backward).
    cfg["gradient_accumulation_steps"] = options.accumulate
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
    # each rank's share under ZeRO 1-3: DeepSpeedSync.clip); only where the
    # engine keeps copies that parallelx does not see does the engine clip,
    # with its own arithmetic.
    cfg["gradient_clipping"] = (options.clip_grad_norm or 0.0) if engine_clips(cfg) else 0.0
    if options.wire_dtype is not None:
        cfg["communication_data_type"] = options.grad_compression
    # Plain torch optimizers (SGD) are what the recipes use; ZeRO runs them fine.
    cfg.setdefault("zero_allow_untested_optimizer", True)
    cfg.setdefault("steps_per_print", 2**31 - 1)
    return cfg


#: DeepSpeed's own defaults of ZeRO's buffer sizes (elements; runtime/zero/config.py), which it keeps
#: whatever the model's size: a 5e8-element reduce bucket is 1.9 GiB of float32 on every rank.
DEEPSPEED_SIZES: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "sub_group_size": 1_000_000_000,
}
#: The smallest bucket parallelx picks (elements): below it a tiny model's buckets would only add collectives.
SMALLEST_BUCKET = 1_000_000
#: A model of up to this many elements gets buckets that hold all of it (at most 95 MiB of float32 a
#: bucket): one reduction and one gather of everything per step, DeepSpeed's own collectives, which a
#: block-sized bucket multiplies (a 3.3 M-parameter GPT's ZeRO-3 step cost 1.045x DeepSpeed's own with
#: 1 M-element buckets, 4 reduce-scatters a step instead of 1; docs/benchmarks.md).  A bigger model's
#: buckets hold at least this much.
WHOLE_MODEL_BUCKET = 25_000_000


def sized_for(largest_unit: int, largest_tensor: int, total: int = 0) -> dict[str, int]:
    """ZeRO's buffer sizes (elements) for a model of ``total`` elements whose largest block (the unit
    fsdp also shards on its own) holds ``largest_unit`` elements and whose largest tensor
    ``largest_tensor``: a bucket holds one block's gradients (or the largest tensor, which DeepSpeed
    cannot split across buckets) and at least the whole model up to :data:`WHOLE_MODEL_BUCKET`, the
    prefetch one bucket ahead, at most two buckets gathered at once and none kept from the forward
    to the backward beyond that, and ZeRO-3's optimizer stepped one bucket's worth of its flat
    partition at a time (a whole-partition step allocates two temporaries the size of the
    partition: 0.75 GiB a rank for a 200 M-parameter model at 2 processes); never above
    DeepSpeed's own defaults.  The parameter persistence threshold is DeepSpeed's (small tensors,
    LayerNorms and biases, stay whole on every rank instead of costing a gather each)."""
    bucket = max(largest_unit, largest_tensor, SMALLEST_BUCKET, min(total, WHOLE_MODEL_BUCKET))
    sized = {
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_max_live_parameters": 2 * bucket,
        "stage3_max_reuse_distance": bucket,
        "sub_group_size": bucket,
    }
    return {k: min(v, DEEPSPEED_SIZES[k]) for k, v in sized.items()}


def zero_sizes(zero: Mapping[str, Any], largest_unit: int, largest_tensor: int, total: int = 0) -> dict[str, int]:
    """The sizes in force: the user's config's where it sets them, else :func:`sized_for`'s, else DeepSpeed's."""
    picked = {**DEEPSPEED_SIZES, **sized_for(largest_unit, largest_tensor, total)}
    return {k: int(zero[k]) if isinstance(zero.get(k), (int, float)) else v for k, v in picked.items()}


def model_sizes(module: nn.Module) -> tuple[int, int, int]:
    """The elements of ``module``'s largest unit (:func:`parallelx.transforms.units.default_units`), of its
    largest parameter and of all its parameters, whole (a ZeRO-3 parameter already partitioned counts its
    ``ds_numel``; a tied weight once)."""

    def numel(p: torch.Tensor) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    seen: set[int] = set()
    largest_unit = 0
    for unit in default_units(module):
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        largest_unit = max(largest_unit, sum(numel(p) for p in own))
    sizes = [numel(p) for p in module.parameters()]  # parameters() yields a tied weight once
    return largest_unit, max(sizes, default=0), sum(sizes)


def with_sizes(cfg: dict[str, Any], largest_unit: int, largest_tensor: int, total: int = 0) -> dict[str, Any]:
    """``cfg`` with ZeRO's buffer sizes the user's config left unset (or ``"auto"``) sized for the model."""
    zero = dict(cfg["zero_optimization"])
    zero.update(zero_sizes(zero, largest_unit, largest_tensor, total))
    return {**cfg, "zero_optimization": zero}


def read_config(config: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
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


def engine_clips(cfg: Mapping[str, Any]) -> bool:
    """True when the engine, not parallelx, must clip: its fp16/bf16 engines
    keep (loss-scaled) copies of the gradients, and ZeRO with the optimizer
    offloaded moves them to the CPU during the backward; parallelx sees
    neither before the step."""
    casts = any(isinstance(cfg.get(k), Mapping) and bool(cfg[k].get("enabled")) for k in ("fp16", "bf16"))
    zero = cfg["zero_optimization"]
    offload = zero.get("offload_optimizer")
    offloaded = isinstance(offload, Mapping) and offload.get("device") not in (None, "none")
    return casts or (zero["stage"] >= 1 and offloaded)


def adopt_config(options: LoopOptions, user: Mapping[str, Any], gas: int | None) -> LoopOptions:
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


def math_changes(user: Mapping[str, Any]) -> list[str]:
    """The entries of a user's config that make the update differ from plain PyTorch."""
    changes = [f"{k}={user[k]!r}" for k, plain in PLAIN_MATH.items() if k in user and user[k] != plain]
    changes += [
        f"{k}.enabled=true"
        for k in _MATH_SECTIONS
        if isinstance(user.get(k), Mapping) and user[k].get("enabled") not in (None, False)
    ]
    if user.get("communication_data_type") not in (None, "fp32"):
        changes.append(f"communication_data_type={user['communication_data_type']!r}")
    if user.get("gradient_accumulation_steps", 1) != 1:
        changes.append(f"gradient_accumulation_steps={user['gradient_accumulation_steps']!r}")
    return changes


#: Where a DeepSpeed user reads the torch form of each config section.
DOCS = "docs/from-deepspeed.md"
#: DeepSpeed's fp16 loss-scaler settings (runtime/fp16/loss_scaler.py, runtime/config.py).
LOSS_SCALER = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def _torch_optimizer(section: Mapping[str, Any]) -> str:
    """The torch optimizer a config ``optimizer`` section stands for, as code."""
    kind = str(section.get("type", "?"))
    params = dict(section.get("params") or {})
    adam_w = params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)
    if kind.lower() in ("adam", "adamw"):
        # DeepSpeed's Adam is AdamW unless adam_w_mode is false, and its weight decay defaults
        # to 0 where torch's AdamW defaults to 0.01: written out either way.
        cls = "AdamW" if kind.lower() == "adamw" or adam_w else "Adam"
        params.setdefault("weight_decay", 0.0)
    elif hasattr(torch.optim, kind):
        cls = kind
    else:
        return f"no torch optimizer is {kind} (DeepSpeed's own); pick a torch.optim optimizer"
    args = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}" for k, v in params.items())
    return f"torch.optim.{cls}(model.parameters(){', ' + args if args else ''})"


def _torch_scheduler(section: Mapping[str, Any]) -> str:
    """What to write for a config ``scheduler`` section."""
    kind = str(section.get("type", "?"))
    params = section.get("params") or {}
    if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        low, steps = params.get("warmup_min_lr", 0), params.get("warmup_num_steps", 1000)
        return (
            f"a torch.optim.lr_scheduler.LambdaLR (or LinearLR) on the torch optimizer (its lr the warm-up's "
            f"top), stepped by backend.step(optimizer, scheduler); DeepSpeed's {kind} runs its first two steps at "
            f"warmup_min_lr={low} and reaches the top after warmup_num_steps={steps}: {DOCS} gives a LambdaLR "
            "with its exact values"
        )
    return f"a torch.optim.lr_scheduler on the torch optimizer, stepped by backend.step(optimizer, scheduler) ({kind})"


def refuse_engine_sections(user: Mapping[str, Any]) -> None:
    """Refuse a config's ``optimizer`` and ``scheduler`` sections, with the torch form of each.

    parallelx steps the script's torch optimizer on every backend and never builds one from a
    config.  Beside the script's optimizer DeepSpeed ignores the ``optimizer`` section without a
    word, and builds the ``scheduler`` section on the script's optimizer: WarmupLR sets the lr to
    its minimum (0 by default) when the engine is built, a scheduler the script then builds on the
    optimizer takes that as its base lr, and the run trains at lr 0.  Without an optimizer given to
    setup the section would give this backend alone an optimizer the script never steps."""
    autotp = user.get("tensor_parallel")
    if isinstance(autotp, Mapping) and int(autotp.get("autotp_size", 1) or 1) > 1:
        # DeepSpeed's AutoTP splits the layers inside deepspeed.initialize, unseen by parallelx: the
        # data would still follow the process's rank, and the checkpoints would hold slices.
        raise ParallelxError(
            f"deepspeed: the config's tensor_parallel section (autotp_size {autotp['autotp_size']}) is DeepSpeed's own "
            "tensor parallelism, which parallelx does not see (each rank would read its own batch, checkpoints "
            f"would hold slices): remove the section and give --tensor-parallel {autotp['autotp_size']} "
            "(tensor_parallel= in get_backend), the same plan on every backend (docs/tensor-parallel.md)"
        )
    sections = [k for k in ("optimizer", "scheduler") if k in user]
    if not sections:
        return
    said = []
    for key in sections:
        section = user[key] if isinstance(user[key], Mapping) else {}
        write = _torch_optimizer(section) if key == "optimizer" else _torch_scheduler(section)
        said.append(f"its {key!r} section ({section.get('type', '?')}): write {write}")
    raise ParallelxError(
        f"deepspeed: the config has {' and '.join(repr(k) for k in sections)} section(s), which parallelx does "
        "not use on any backend: the script's torch optimizer (and scheduler) are the ones stepped, and DeepSpeed "
        "would ignore the optimizer section beside it and set the script's lr from the scheduler section (WarmupLR "
        "starts at warmup_min_lr, 0 by default, the base lr a script's scheduler then takes). Remove the "
        f"section(s) from the config and, in the script, {'; '.join(said)}. See {DOCS}"
    )


def config_line(
    user: Mapping[str, Any],
    cfg: Mapping[str, Any],
    asked: LoopOptions,
    options: LoopOptions,
    *,
    zero_stage: int | None,
    micro_batch_size: int | None,
) -> tuple[str, bool]:
    """One line: what the run adopts from the user's config ``user`` into the loop options
    (``asked`` before, ``options`` after), what it keeps for DeepSpeed's engine as it is,
    what it overrides (``cfg`` is the engine's config), and which entries make the update
    differ from the other backends'.  True with it when the line changes the update (a warning)."""
    adopted: list[str] = []
    overridden: list[str] = []
    kept: list[str] = []
    gas = user.get("gradient_accumulation_steps")
    if gas not in (None, "auto"):
        if options.accumulate != asked.accumulate:
            adopted.append(f"gradient_accumulation_steps={gas} as --accumulate {options.accumulate}")
        elif int(gas) != options.accumulate:
            overridden.append(f"gradient_accumulation_steps={gas} (--accumulate {options.accumulate})")
    clip = user.get("gradient_clipping")
    if isinstance(clip, (int, float)) and clip > 0:
        who = (
            "clipped by DeepSpeed's engine, which holds the 16-bit or offloaded gradients"
            if engine_clips(cfg)
            else "clipped by parallelx as on every backend; the engine's own clipping set to 0"
        )
        if asked.clip_grad_norm is None:
            adopted.append(f"gradient_clipping={clip} as --clip-grad-norm {clip} ({who})")
        elif asked.clip_grad_norm != clip:
            overridden.append(f"gradient_clipping={clip} (--clip-grad-norm {asked.clip_grad_norm})")
    zero = user.get("zero_optimization")
    zero = zero if isinstance(zero, Mapping) else {}
    if "stage" in zero:
        if zero_stage is None or zero_stage == zero["stage"]:
            adopted.append(f"zero_optimization.stage={zero['stage']}")
        else:
            overridden.append(f"zero_optimization.stage={zero['stage']} (--zero-stage {zero_stage})")
    if "train_batch_size" in user:
        overridden.append(
            f"train_batch_size={user['train_batch_size']} (dropped: a step's batch is the script's loader's "
            "batch x processes x --accumulate)"
        )
    if micro_batch_size is not None and user.get("train_micro_batch_size_per_gpu") not in (None, micro_batch_size):
        overridden.append(f"train_micro_batch_size_per_gpu={user['train_micro_batch_size_per_gpu']} (--batch-size)")
    for half in ("fp16", "bf16"):
        section = user.get(half)
        if isinstance(section, Mapping) and section.get("enabled") not in (None, False):
            scaler = [f"{k}={section[k]}" for k in LOSS_SCALER if k in section]
            kept.append(f"{half} ({', '.join(['enabled', *scaler])})")
    if options.precision == "16-mixed" and not kept and isinstance(user.get("fp16"), Mapping):
        scaler = [f"{k}={user['fp16'][k]}" for k in LOSS_SCALER if k in user["fp16"]]
        if scaler:
            kept.append(f"fp16's loss scaler under --precision 16-mixed ({', '.join(scaler)})")
    tuning = [k for k in zero if k != "stage"]
    if tuning:
        kept.append(f"zero_optimization's {', '.join(tuning)}")
    handled = {"gradient_accumulation_steps", "gradient_clipping", "zero_optimization", "train_batch_size"}
    handled |= {"train_micro_batch_size_per_gpu", "fp16", "bf16"}
    kept += [k for k in user if k not in handled]
    differs = [c for c in math_changes(user) if not c.startswith(("gradient_clipping", "gradient_accumulation"))]
    if options.precision == "16-mixed":
        differs = [c for c in differs if c != "fp16.enabled=true"]  # what 16-mixed is on this backend
    parts = [f"adopted {', '.join(adopted)}"] if adopted else []
    parts += [f"overridden: {', '.join(overridden)}"] if overridden else []
    parts += [f"kept for DeepSpeed's engine: {', '.join(kept)}"] if kept else []
    if differs:
        parts.append(f"the update differs from the other backends' by {', '.join(differs)}")
    line = "deepspeed: from the config, " + ("; ".join(parts) or "nothing (it is empty)")
    return line, options != asked or bool(differs)


def zero_memory(stage: int, model: ModelCounts, world_size: int, training: Training) -> RankMemory:
    """What a rank holds under ZeRO ``stage`` with the sizes parallelx picks (:func:`sized_for`).

    Under ``16-mixed`` DeepSpeed's float16 engine holds the weights and gradients in float16 and
    a float32 master copy; otherwise the weights stay float32 and ZeRO 1 and 2 still clone their
    float32 partition (the masters) from them, where ZeRO-3 steps its float32 partitions in place.
    Stages 1 and 2 flatten the weights into one buffer (a second copy while it is made); ZeRO 2 and
    3 reduce the gradients through one
    bucket of ``reduce_bucket_size`` elements, ZeRO-3 gathers at most
    ``stage3_max_live_parameters`` elements plus one prefetch."""
    n = max(1, world_size)
    sizes = zero_sizes({}, model.largest_unit_numel, model.largest_tensor_numel, model.numel)
    numel = model.trainable_numel
    half = training.precision == "16-mixed"
    elem = 2 if half else max(1, model.trainable_bytes // max(1, numel))
    weights = model.param_bytes // 2 if half else model.param_bytes
    masters = 4 * numel  # float32 copies of the trained weights
    state = training.states * masters
    name = f"deepspeed zero{stage}"
    eager = training.build == "eager"
    if stage == 0:
        return layout(
            name,
            model,
            n,
            training,
            param_bytes=weights,
            grad_bytes=numel * elem,
            extra=masters if half else 0,
            why="float32 masters" if half else "",
            setup=model.state_bytes + (masters if half else 0),
            transient=training.temporaries * model.largest_tensor_bytes
            + min(numel, DEEPSPEED_SIZES["allgather_bucket_size"]) * elem,
        )
    reduce_bucket = min(numel, sizes["reduce_bucket_size"]) * elem
    gather_bucket = min(numel, sizes["allgather_bucket_size"]) * elem
    if stage in (1, 2):
        grads_whole = stage == 1
        extra = shard(masters, n) + (shard(numel * 4, n) if grads_whole else reduce_bucket)
        return layout(
            name,
            model,
            n,
            training,
            shards=("optimizer",) if grads_whole else ("grads", "optimizer"),
            param_bytes=weights,
            grad_bytes=numel * elem,
            extra=extra,
            why="float32 master partition, "
            + ("the averaged gradients' partition" if grads_whole else "reduce bucket"),
            setup=(model.state_bytes if eager else 0) + weights + shard(masters, n),
            # The optimizer steps the whole flat float32 partition at once.
            transient=training.temporaries * shard(masters, n) + gather_bucket + (reduce_bucket if grads_whole else 0),
        ).with_optimizer(shard(state, n))
    live = min(numel, sizes["stage3_max_live_parameters"] + sizes["stage3_prefetch_bucket_size"]) * elem
    sub_group = min(shard(masters, n), 4 * sizes["sub_group_size"])  # the float32 bytes stepped at once
    # Float32 weights are their own masters (_deepspeed_zero.share_float32_masters); 16-bit ones get
    # a float32 partition.
    masters_copy = shard(masters, n) if half else 0
    return layout(
        name,
        model,
        n,
        training,
        shards=("params", "grads", "optimizer"),
        param_bytes=weights,
        grad_bytes=numel * elem,
        extra=masters_copy + reduce_bucket,
        why=("float32 master partition, " if half else "") + "reduce bucket",
        # The engine waits for the first forward (DeepSpeedModel): set-up holds an eager model whole,
        # a meta one as its partitions, each tensor computed whole one at a time.  The build, at the
        # first forward, stays under the step's peak: the partitions copied into one flat buffer (two
        # copies while it copies), a gradient buffer for the largest sub-group (freed), the reduce
        # bucket and the gradients' flat partition; the optimizer's state waits for the first step.
        setup=model.state_bytes if eager else None,
        # The optimizer steps one sub-group of the flat float32 partition at a time.
        transient=training.temporaries * sub_group + live,
    ).with_optimizer(shard(state, n))
