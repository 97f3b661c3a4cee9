"""A DeepSpeed checkpoint folder (what ``engine.save_checkpoint(dir)`` writes, and DeepSpeed's
``zero_to_fp32.py`` reads) as pretrained weights: the whole float32 weights, put together from every
rank's ZeRO partitions by DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``.

    run/latest                                           the newest tag, e.g. global_step1000
    run/global_step1000/mp_rank_00_model_states.pt       the module (ZeRO 0-2), the shapes
    run/global_step1000/zero_pp_rank_<R>_mp_rank_00_optim_states.pt   rank R's float32 partitions (ZeRO 1-3)
    run/global_step1000/zero_pp_rank_<R>_mp_rank_00_model_states.pt   (ZeRO-3, in place of the first)

DeepSpeed reads its files with ``weights_only=False``; every file is read here first with
``weights_only=True`` and only DeepSpeed's own plain classes allowed (its loss scaler, the ZeRO stage,
a fragment's address), so a file holding anything else is refused before DeepSpeed opens it.  A
folder in a store is downloaded to a temporary folder first (every partition is read whole).
"""

from __future__ import annotations

import importlib
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from parallelx import storage
from parallelx.errors import ParallelxError, first_line
from parallelx.storage import Location

#: The classes DeepSpeed pickles into its checkpoint files beside the tensors: allowed, nothing else.
_ALLOWED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_MODEL_STATES = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")


def tag_folder(loc: Location) -> Location | None:
    """The folder of one saved step when ``loc`` is a DeepSpeed checkpoint folder (the one named in its
    ``latest``) or such a step's folder itself; None when it is neither."""
    if storage.is_file(storage.join(loc, "latest")):
        tag = storage.read_bytes(storage.join(loc, "latest")).decode().strip()
        step = storage.join(loc, tag)
        return step if _holds_model_states(step) else None
    return loc if _holds_model_states(loc) else None


def _holds_model_states(loc: Location) -> bool:
    try:
        names = loc.iterdir() if isinstance(loc, Path) else storage.listdir(loc)
        return any(_MODEL_STATES.fullmatch(n if isinstance(n, str) else n.name) for n in names)
    except (OSError, ParallelxError):
        return False


def read(step: Location) -> dict[str, torch.Tensor]:
    """The whole float32 weights of the DeepSpeed checkpoint step folder ``step``, by the model's names."""
    if not isinstance(step, Path):
        with tempfile.TemporaryDirectory(prefix="parallelx-deepspeed-") as tmp:
            local = Path(tmp) / storage.name(step)
            local.mkdir()
            for name in storage.listdir(step):
                if name.endswith(".pt"):
                    storage.download(storage.join(step, name), local / name)
            return read(local)
    files = sorted(step.glob("*.pt"))
    allowed = _allowed_classes(step)
    for f in files:  # strictly first: DeepSpeed's reader below unpickles whatever a file holds
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ParallelxError(
                f"{f}: not read: it holds more than tensors and DeepSpeed's own plain values "
                f"({first_line(exc)[:200]}); parallelx reads checkpoints with weights_only=True"
            ) from None
    if not any(f.name.startswith("zero_pp_rank_") and f.name.endswith("_optim_states.pt") for f in files):
        # ZeRO-0: no partitions; the module's own weights are in the model states file.
        state = torch.load(files[0] if len(files) == 1 else step / "mp_rank_00_model_states.pt", weights_only=True)
        return {k: v for k, v in (state.get("module") or {}).items() if isinstance(v, torch.Tensor)}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        merged = get_fp32_state_dict_from_zero_checkpoint(str(step.parent), tag=step.name)
    except Exception as exc:
        raise ParallelxError(f"{step}: DeepSpeed could not put its partitions together: {first_line(exc)}") from None
    return {k: v for k, v in merged.items() if isinstance(v, torch.Tensor)}


def _allowed_classes(step: Path) -> list[Any]:
    try:
        importlib.import_module("deepspeed")
    except ImportError:
        raise ParallelxError(
            f"{step}: a DeepSpeed checkpoint is put together by DeepSpeed's own code: pip install deepspeed"
        ) from None
    out = []
    for dotted in _ALLOWED:
        module, _, name = dotted.rpartition(".")
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            out.append(found)
    return out
