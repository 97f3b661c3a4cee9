"""``torch.compile`` on every backend.

Each backend compiles where its wrapper needs it (``Backend._compile``):

- ``single``, ``dp``, ``horovod``: the model, in place (``nn.Module.compile``,
  which keeps the module and its ``state_dict`` names);
- ``ddp``: the ``DistributedDataParallel`` module, in place: Dynamo's
  DDPOptimizer then splits the graph at DDP's bucket boundaries, so the
  gradient all-reduce still overlaps the backward;
- ``fsdp``: each unit before ``fully_shard``, as torchtitan does (a compiled
  block between FSDP2's gathers and reduce-scatters);
- ``deepspeed``: the engine's own ``compile()``, once it is built.

A model the user compiled before ``setup`` (``torch.compile(model)``, an
``OptimizedModule``) is unwrapped first and compiled again the backend's way
with the backend's options: compiling the whole model before wrapping would
put DDP's hooks and FSDP's gathers inside one graph.  Checkpoints never see
compile's ``_orig_mod.`` prefix (:mod:`parallelx.parts.stateio`).

Random operators (dropout) draw eager's numbers by default: inductor's own generator draws other
masks, so a compiled run with dropout would leave eager's (and the other backends') numbers
after the first step (8 % apart in the weights after one epoch of the GPT recipe at dropout
0.1).  Inductor's ``fallback_random`` calls eager's random kernels instead; its cost is
measured by ``python -m benchmarks.compile --models gpt --dropout 0.1 --compile-random both``
(docs/transformers.md).  On GPUs, where inductor fuses its Philox draws into the kernels,
``eager_random=False`` (``--compile-random inductor``) buys that speed back at the price of
other masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from parallelx.errors import ParallelxError

#: ``torch.compile``'s modes (``None``: its default).
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """Whether and how models are compiled (``--compile``, ``--compile-mode``)."""

    enabled: bool = False
    mode: str = "default"
    #: One graph per compiled module, or an error (torch.compile's ``fullgraph``).
    fullgraph: bool = False
    #: Random operators draw eager's numbers (inductor's ``fallback_random``), so that compiled and
    #: eager runs agree with dropout on; False lets inductor draw its own (``--compile-random inductor``).
    eager_random: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ParallelxError(f"compile mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @classmethod
    def of(cls, value: bool | str | CompileOptions | None) -> CompileOptions:
        """From ``compile=``: a bool, a mode name, or options."""
        if isinstance(value, CompileOptions):
            return value
        if isinstance(value, str):
            return cls(enabled=True, mode=value)
        return cls(enabled=bool(value))

    @property
    def kwargs(self) -> dict[str, Any]:
        """What ``torch.compile`` / ``nn.Module.compile`` take.  torch.compile refuses a mode and
        inductor options together, so the mode is passed as the options it stands for."""
        from torch._inductor import list_mode_options

        inductor = {} if self.mode == "default" else dict(list_mode_options(self.mode))
        inductor["fallback_random"] = self.eager_random
        return {"options": inductor, "fullgraph": self.fullgraph}


def uncompiled(model: nn.Module) -> tuple[nn.Module, bool]:
    """``model`` without ``torch.compile``'s wrapper, and whether it had one."""
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule keeps the module here
    if isinstance(inner, nn.Module):
        return uncompiled(inner)[0], True
    return model, False


def compile_in_place(module: nn.Module, options: CompileOptions) -> None:
    """Compile ``module``'s forward where it is: its type, its submodules and its state names stay."""
    module.compile(**options.kwargs)
