"""The DeepSpeed config the ``deepspeed`` backend builds, for DeepSpeed's engine.

A user's config file (or dict) is read, completed by the constructor's
options (explicit ones win), and DeepSpeed's defaults that change the update
are set to the plain values unless the file sets them (:data:`PLAIN_MATH`);
entries that do change the math are named, so the backend can say so.

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

from parallelx.errors import ParallelxError
from parallelx.parts.loop import LoopOptions

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
    if "scheduler" in user:
        changes.append("a scheduler (stepped inside optimizer.step())")
    return changes
