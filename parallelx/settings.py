"""Settings every backend checks and applies the same way: the collective
timeout, the device asked for and the one picked, the CPU threads of each
process, the reduce operations.  A leaf module: it imports only parallelx's
errors and utils."""

from __future__ import annotations

import argparse
import os
from typing import Any, Literal, cast

import torch

from parallelx.errors import ParallelxError
from parallelx.transforms.compiling import CompileOptions
from parallelx.utils import threads_per_process

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "max", "min")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")

DEFAULT_TIMEOUT_S = 1800.0


def default_timeout() -> float:
    """Collective timeout in seconds: ``$PARALLELX_TIMEOUT`` or 30 minutes."""
    raw = os.environ.get("PARALLELX_TIMEOUT")
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ParallelxError(f"PARALLELX_TIMEOUT must be a number of seconds, got {raw!r}") from None
    return check_timeout(value, "PARALLELX_TIMEOUT")


def check_timeout(value: float, what: str) -> float:
    if not value > 0 or value == float("inf"):  # also rejects nan
        raise ParallelxError(f"{what} must be a finite number of seconds > 0, got {value}")
    return value


def check_op(op: str) -> ReduceOp:
    if op not in REDUCE_OPS:
        raise ParallelxError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")
    return cast(ReduceOp, op)


def check_device(device: str | torch.device | None) -> str:
    if device is None:
        return "auto"
    name = device.type if isinstance(device, torch.device) else str(device)
    if name not in DEVICES:
        raise ParallelxError(
            f"device must be one of {', '.join(DEVICES)}, got {device!r} "
            "(the GPU index follows the process's local rank)"
        )
    return name


def pick_device(request: str, index: int, who: str) -> torch.device:
    """The device for a process that may use GPU ``index``: the user's choice
    (``cpu`` forces the CPU on a GPU machine), else that GPU when there is one,
    else the CPU.  ``who`` names the backend in the error."""
    if request == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < gpus:
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if request == "cuda":
        raise ParallelxError(
            f"{who}: device 'cuda' asked for, but this process needs GPU {index} and "
            f"{gpus} GPU(s) are visible; use fewer processes per machine or --device cpu"
        )
    return torch.device("cpu")


def limit_cpu_threads(device: torch.device, local_world_size: int) -> None:
    """On the CPU, give each process on this machine its share of the cores:
    torch's default (all cores in every process) oversubscribes them and slows
    every rank down.  An explicit ``OMP_NUM_THREADS`` from the user or the
    launcher is left alone."""
    if device.type == "cpu" and local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_process(local_world_size))


def common_options(args: argparse.Namespace) -> dict[str, Any]:
    """The constructor options every backend takes, from parsed command-line args."""
    options: dict[str, Any] = {}
    if getattr(args, "timeout", None) is not None:
        options["timeout"] = args.timeout
    if getattr(args, "dump_stacks", None):
        options["dump_stacks"] = args.dump_stacks
    if getattr(args, "device", None) not in (None, "auto"):
        options["device"] = args.device
    for key in ("accumulate", "clip_grad_norm", "precision", "grad_compression"):
        if getattr(args, key, None) is not None:
            options[key] = getattr(args, key)
    mode = getattr(args, "compile_mode", None)
    randomness = getattr(args, "compile_random", None)
    if getattr(args, "compile", False) or mode is not None or randomness is not None:
        options["compile"] = mode or True
        if randomness is not None:
            options["compile"] = CompileOptions(
                enabled=True, mode=mode or "default", eager_random=randomness == "eager"
            )
    if getattr(args, "cpu_offload", False):
        options["cpu_offload"] = True
    if getattr(args, "tensor_parallel", None) is not None:
        options["tensor_parallel"] = args.tensor_parallel
    if getattr(args, "sequence_parallel", False):
        options["sequence_parallel"] = True
    if getattr(args, "loss_parallel", False):
        options["loss_parallel"] = True
    checkpointing = getattr(args, "activation_checkpointing", None)
    if checkpointing is not None:
        names = [n.strip() for n in checkpointing.split(",") if n.strip()]
        options["activation_checkpointing"] = True if names in ([], ["auto"]) else names
    return options
