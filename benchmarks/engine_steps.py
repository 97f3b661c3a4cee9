"""One training step of a small GPT written with each engine's own loop, and the same step through
parallelx, in the same processes; and what one step does on the wire and to the host.

The engines' loops, as their guides write them:

- ``ddp``: ``DistributedDataParallel(model)``, ``loss.backward()``, ``optimizer.step()``,
  ``optimizer.zero_grad()``;
- ``fsdp``: FSDP2, ``fully_shard`` on each block, then on the root (torchtitan's order), the same loop;
- ``zero0`` .. ``zero3``: ``deepspeed.initialize`` with that stage, float32, ``engine.backward(loss)``,
  ``engine.step()`` (DeepSpeed's default clipping off, as parallelx and every other loop here).

parallelx's is the loop it documents: ``backend.backward(loss)``, ``backend.step(optimizer)``.
The model is nanoGPT's (``recipes.models.GPT``: tied embedding) with AdamW in nanoGPT's two groups.

:func:`count_step` counts what one step does: every collective a process group runs (torch's Flight
Recorder, which sees the transport's calls whoever makes them, DDP's C++ reducer and FSDP2's and
DeepSpeed's included), with its bytes, and every read of a tensor's value by the host (a
``TorchDispatchMode`` counting ``aten._local_scalar_dense``, behind ``.item()``, ``bool(t)``,
``int(t)``, ``float(t)``; ``.tolist()`` and ``.numpy()``; a copy from an accelerator to the CPU;
an accelerator synchronize).  ``tests/launcher/test_step_counts.py`` asserts that parallelx adds
none; ``benchmarks/step_ab.py`` times the two steps.

The Flight Recorder must be on before the first process group is made: call
:func:`enable_flight_recorder` first.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

#: engine name -> (its launcher, parallelx's command line for it)
ENGINES: dict[str, tuple[str, list[str]]] = {
    "ddp": ("torchrun", ["--backend", "ddp"]),
    "fsdp": ("torchrun", ["--backend", "fsdp"]),
    **{f"zero{z}": ("deepspeed", ["--backend", "deepspeed", "--zero-stage", str(z)]) for z in range(4)},
}

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Job:
    """The model and batch of one comparison."""

    vocab: int
    block: int
    layers: int
    width: int
    heads: int
    batch: int
    lr: float = 1e-3
    weight_decay: float = 0.1


#: The counting test's: width 160 puts the MLP's weights (102,400 elements) above ZeRO-3's
#: persistence threshold (1e5: gathered every step) and the attention's (76,800) below it.
TINY = Job(vocab=64, block=16, layers=2, width=160, heads=2, batch=2)
#: The counting test's engines: TINY's blocks, six of them (1.9 M elements in all, 0.3 M a block): more
#: than ZeRO's smallest bucket (1e6 elements), so buckets that split the model's reductions or gathers
#: where the engine's own sizes do not show as collectives the engine's step does not make.
COUNTED = Job(vocab=64, block=16, layers=6, width=160, heads=2, batch=2)
#: The step-time comparison's (docs/benchmarks.md): 4 blocks of width 256, context 128, batch 16.
SMALL = Job(vocab=512, block=128, layers=4, width=256, heads=4, batch=16)
JOBS = {"tiny": TINY, "counted": COUNTED, "small": SMALL}


def build(job: Job) -> nn.Module:
    """The GPT, from the same seed on every rank and in every implementation."""
    from recipes.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            vocab_size=job.vocab,
            block_size=job.block,
            n_layer=job.layers,
            n_head=job.heads,
            n_embd=job.width,
            dropout=0.0,
        )
    )


def make_optimizer(model: nn.Module, job: Job) -> torch.optim.Optimizer:
    from recipes.models import gpt_param_groups

    return torch.optim.AdamW(gpt_param_groups(model, job.weight_decay), lr=job.lr, betas=(0.9, 0.95))


def batch(job: Job, rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens of step ``step``: inputs and next-token targets."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(job.vocab, (job.batch, job.block + 1), generator=g)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


# ------------------------------------------------------------------ the engines' own loops
def raw_step(engine: str, job: Job, device: torch.device) -> tuple[Step, nn.Module]:
    """``engine``'s own loop on a fresh model; the step and the module holding the weights."""
    return RAW[engine](job, device)


def _raw_ddp(job: Job, device: torch.device) -> tuple[Step, nn.Module]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(job)
    wrapped: nn.Module = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    return _torch_step(wrapped, make_optimizer(wrapped, job)), model


def _raw_fsdp(job: Job, device: torch.device) -> tuple[Step, nn.Module]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(job)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model.to(device)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _torch_step(model, make_optimizer(model, job)), model


def _raw_zero(stage: int, job: Job, device: torch.device) -> tuple[Step, nn.Module]:
    import deepspeed

    model = build(job)
    config = {
        "train_micro_batch_size_per_gpu": job.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default since 0.19.3; nobody else does
        "steps_per_print": 10**9,
    }
    ds, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, job), config=config)

    def ds_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(ds(x), y)
        ds.backward(loss)
        ds.step()
        return loss

    return ds_step, ds.module


RAW: dict[str, Callable[[Job, torch.device], tuple[Step, nn.Module]]] = {
    "ddp": _raw_ddp,
    "fsdp": _raw_fsdp,
    **{f"zero{z}": functools.partial(_raw_zero, z) for z in range(4)},
}


def _torch_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def px_step(backend: Any, job: Job) -> tuple[Step, nn.Module]:
    """parallelx's documented loop on a fresh model, through ``backend`` (initialised)."""
    base = build(job)
    model, optimizer = backend.setup(base, make_optimizer(base, job))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model(x), y)
        backend.backward(loss)
        backend.step(optimizer)
        return loss

    return step, model


def px_backend(engine: str, job: Job) -> Any:
    """parallelx's backend for ``engine``, from its command line, not yet initialised."""
    import argparse

    import parallelx

    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    args = parser.parse_args(ENGINES[engine][1])
    args.batch_size = job.batch  # DeepSpeed's config wants the per-process micro-batch
    return parallelx.from_args(args)


def init_world(launcher: str) -> None:
    """Join the process group as ``launcher``'s own scripts do; parallelx's backends then adopt it."""
    if launcher == "torchrun":
        dist.init_process_group("gloo")
        return
    import deepspeed

    from backends.deepspeed import extensions_dir

    # The ops parallelx's set-up built (a JIT build elsewhere takes minutes on 2 cores).
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


# ------------------------------------------------------------------------------ counting
def enable_flight_recorder(entries: int = 20000) -> None:
    """Keep the last ``entries`` collectives of every process group (before any group is made)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


@dataclass
class Counts:
    """What one step did: its collectives (kind, element counts, dtype, process group) and host reads."""

    collectives: list[dict[str, Any]] = field(default_factory=list)
    host_reads: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(c["bytes"] for c in self.collectives)

    def kinds(self) -> dict[str, int]:
        return dict(collections.Counter(c["kind"] for c in self.collectives))

    def as_dict(self) -> dict[str, Any]:
        return {"collectives": self.collectives, "host_reads": self.host_reads, "bytes": self.bytes}


_ITEMSIZE = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
}


def _collectives() -> list[dict[str, Any]]:
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    out = []
    for e in trace.get("entries", []):
        sizes = [list(s) for s in e.get("input_sizes", [])]
        dtypes = list(e.get("input_dtypes", []))
        nbytes = 0
        for shape, dtype in zip(sizes, dtypes, strict=False):
            n = 1
            for d in shape:
                n *= int(d)
            nbytes += n * _ITEMSIZE.get(dtype, 4)
        pg = e.get("process_group", ("", ""))
        out.append(
            {
                "kind": str(e.get("profiling_name", "?")).split(":")[-1],
                "sizes": sizes,
                "dtypes": dtypes,
                "bytes": nbytes,
                "group": str(pg[1] if len(pg) > 1 else pg),
            }
        )
    return out


class _HostReads(TorchDispatchMode):
    """Counts the operators whose result the host reads (a synchronisation on an accelerator)."""

    def __init__(self, counter: collections.Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in ("aten._local_scalar_dense", "aten.equal", "aten.allclose"):
            self.counter[f"{name.split('.', 1)[1]} (item, bool, int, float)"] += 1
        elif name in ("aten._to_copy", "aten.copy_") and args:
            src = args[1] if name == "aten.copy_" else args[0]
            dst = kwargs.get("device") if name == "aten._to_copy" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and str(dst) == "cpu":
                self.counter["copy to the CPU"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _python_reads(counter: collections.Counter[str]) -> Iterator[None]:
    """``tolist``/``numpy`` read a tensor without an operator; an accelerator's synchronize neither."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[name] += 1
            return original(*args, **kwargs)

        patched.append((owner, name, original))
        setattr(owner, name, counted)

    wrap(torch.Tensor, "tolist")
    wrap(torch.Tensor, "numpy")
    wrap(torch.cuda, "synchronize")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def count_step(step: Step, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Counts]:
    """Run one step, counting its collectives (every process group's, through the Flight Recorder)
    and its host reads; every rank calls it (a barrier before and after lets no other collective in)."""
    dist.barrier()
    torch._C._distributed_c10d._reset_fr_trace()
    counter: collections.Counter[str] = collections.Counter()
    with _python_reads(counter), _HostReads(counter):
        loss = step(x, y)
    found = _collectives()
    dist.barrier()
    return loss.detach(), Counts(found, dict(counter))


def differences(raw: Counts, px: Counts) -> list[str]:
    """What parallelx's step did that the engine's did not: collectives beyond the engine's (by
    kind, shapes and dtype, whatever the group), more bytes, more host reads of any kind."""
    problems: list[str] = []

    def key(c: dict[str, Any]) -> tuple[Any, ...]:
        return (c["kind"], tuple(tuple(s) for s in c["sizes"]), tuple(c["dtypes"]))

    left = collections.Counter(key(c) for c in raw.collectives)
    for c in px.collectives:
        if left[key(c)] > 0:
            left[key(c)] -= 1
        else:
            problems.append(f"an extra {c['kind']} of {c['sizes']} {c['dtypes']} ({c['bytes']} bytes) on {c['group']}")
    if px.bytes > raw.bytes:
        problems.append(f"{px.bytes} bytes through collectives against the engine's {raw.bytes}")
    for what, n in px.host_reads.items():
        if n > raw.host_reads.get(what, 0):
            problems.append(f"{n} host reads by {what} against the engine's {raw.host_reads.get(what, 0)}")
    return problems
