"""What a benchmark run measures: the implementations, the modes, the
machine's process and thread counts, and every launch in order."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.workload import BenchError, Case, cpu_cores

FAMILIES = ("ddp", "horovod", "deepspeed")
#: PyTorch's own: measured at every batch size, and in the 1-process scaling runs.
REFERENCE = FAMILIES[0]
TITLES = {"ddp": "DDP", "horovod": "Horovod", "deepspeed": "DeepSpeed"}
PARTS = (*FAMILIES, "scaling", "same-process")
#: (measured, baseline): what the overhead tables compare.
PAIRS = [(f"{kind}-{f}", f"raw-{f}") for kind in ("px", "ctl") for f in FAMILIES]


@dataclass(frozen=True, kw_only=True)
class Impl:
    """One way of running the workload: a worker module, started by the launcher of ``family``."""

    name: str
    family: str  # the backend it exercises, whose launcher starts it
    module: str
    label: str
    args: tuple[str, ...] = ()
    paired: bool = False  # runs the plain and the parallelx step itself (benchmarks.same_process)


@dataclass(frozen=True)
class LoopConfig:
    """One configuration of ``benchmarks.loops``: a backend with parallelx's loop options (its own flags)."""

    name: str
    backend: str
    options: tuple[str, ...]
    label: str
    buys: str  # what the option changes, for the report


#: Micro-batches per optimizer step in the accumulating configurations.
LOOP_ACCUMULATE = 4
_ACC, _BF16 = ("--accumulate", str(LOOP_ACCUMULATE)), ("--grad-compression", "bf16")
#: benchmarks.loops: the baseline first (one process with all the cores), then plain DDP and each
#: option alone and together.
LOOPS = tuple(
    LoopConfig(*row)
    for row in (
        (
            "single",
            "single",
            (),
            "1 process (all cores)",
            "the baseline: no communication, both cores in one process's torch threads",
        ),
        (
            "single-acc4",
            "single",
            _ACC,
            "1 process, accumulate 4",
            "one optimizer step per 4 micro-batches (the only saving accumulation gives one process)",
        ),
        ("ddp", "ddp", (), "DDP", "one gradient all-reduce per micro-batch"),
        (
            "ddp-acc4",
            "ddp",
            _ACC,
            "DDP, accumulate 4",
            "one all-reduce (and one optimizer step) per 4 micro-batches: DDP's no_sync inside the window",
        ),
        (
            "ddp-bf16",
            "ddp",
            _BF16,
            "DDP, bf16 gradients",
            "half the bytes on the wire (bfloat16 comm hook), for two casts per step",
        ),
        (
            "ddp-acc4-bf16",
            "ddp",
            (*_ACC, *_BF16),
            "DDP, accumulate 4 + bf16",
            "both: a quarter of the all-reduces, each half as large",
        ),
    )
)


def _impls() -> dict[str, Impl]:
    def plain(name: str, family: str, label: str) -> Impl:
        return Impl(name=name, family=family, module="benchmarks.plain", args=("--framework", family), label=label)

    px = "benchmarks.px_worker"
    out = [
        i
        for f in FAMILIES
        for i in (
            plain(f"raw-{f}", f, f"{TITLES[f]} (plain)"),
            Impl(name=f"px-{f}", family=f, module=px, args=("--backend", f), label=f"{TITLES[f]} (parallelx)"),
        )
    ]
    # --control: each plain script a second time, compared with itself.  No difference exists by
    # construction, so its ratio and interval show what the machine's noise alone makes of a ratio.
    out += [plain(f"ctl-{f}", f, f"{TITLES[f]} (plain, again)") for f in FAMILIES]
    out += [
        Impl(
            name=f"same-{f}",
            family=f,
            module="benchmarks.same_process",
            args=("--backend", f),
            label=f"{TITLES[f]} (same process)",
            paired=True,
        )
        for f in FAMILIES
    ]
    out += [
        Impl(
            name=f"loop-{c.name}",
            family=c.backend,
            module=px,
            label=c.label,
            args=("--backend", c.backend, "--loop", *c.options),
        )
        for c in LOOPS
    ]
    return {i.name: i for i in out}


IMPLS = _impls()


@dataclass(frozen=True, kw_only=True)
class Preset:
    """How much to measure.  Batches are per process (weak scaling)."""

    lenet_batches: tuple[int, ...]  # DDP (and scaling) runs measure each of these
    lenet_batch: int  # the LeNet batch of every other backend
    lenet_warmup: int
    lenet_steps: int
    vgg_batch: int
    vgg_warmup: int
    vgg_steps: int
    image_size: int
    repeats: int  # raw/px alternations (A B, B A, ...)
    vgg_repeats: int  # of which the first ones include VGG16
    scaling_all: bool  # 1-process runs of every backend and of VGG16, not only DDP's LeNet
    same_blocks: int  # same-process part: alternating blocks of each implementation
    same_steps: int  # ... and timed LeNet steps per block (after 2 untimed)
    timeout_s: float  # per launch


PRESETS: dict[str, Preset] = {
    # Only checks that everything runs; its numbers mean nothing.
    "smoke": Preset(
        lenet_batches=(32,),
        lenet_batch=32,
        lenet_warmup=1,
        lenet_steps=3,
        vgg_batch=2,
        vgg_warmup=0,
        vgg_steps=1,
        image_size=32,
        repeats=1,
        vgg_repeats=1,
        scaling_all=False,
        same_blocks=2,
        same_steps=2,
        timeout_s=240,
    ),
    # A 2-core CPU machine in under 5 minutes: VGG16 (138 M parameters) for a few steps in the first round.
    "quick": Preset(
        lenet_batches=(64, 128, 256),
        lenet_batch=256,
        lenet_warmup=3,
        lenet_steps=30,
        vgg_batch=4,
        vgg_warmup=1,
        vgg_steps=2,
        image_size=64,
        repeats=2,
        vgg_repeats=1,
        scaling_all=False,
        same_blocks=10,
        same_steps=8,
        timeout_s=240,
    ),
    # Real hardware (GPUs: one process each, NCCL).
    "full": Preset(
        lenet_batches=(64, 128, 256, 512),
        lenet_batch=256,
        lenet_warmup=20,
        lenet_steps=200,
        vgg_batch=32,
        vgg_warmup=5,
        vgg_steps=40,
        image_size=224,
        repeats=4,
        vgg_repeats=2,
        scaling_all=True,
        same_blocks=20,
        same_steps=50,
        timeout_s=1800,
    ),
}


@dataclass(kw_only=True)
class Job:
    """One launch: an implementation with N processes running a list of cases."""

    impl: str
    nproc: int
    threads: int
    cases: list[Case]
    repeat: int
    extra_args: tuple[str, ...] = ()  # for the worker, after --plan
    seconds: float = 0.0
    error: str | None = None

    @property
    def tag(self) -> str:
        return f"{self.impl}-n{self.nproc}-r{self.repeat}"

    def out(self, work: Path) -> Path:
        """Where this launch writes its result files (and, in the first round, weights)."""
        return work / "out" / self.tag


@dataclass(kw_only=True)
class Machine:
    gpus: int
    cores: int
    nproc: int
    threads_n: int  # torch threads per process when nproc processes share the machine
    threads_1: int  # ... when one process has it alone
    comm: str  # what the process groups use: nccl or gloo
    bind_cores: bool  # each CPU process pinned to its own block of cores


def detect_machine(nproc: int | None, bind_cores: bool = True) -> Machine:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores, n = cpu_cores(), nproc or (gpus if gpus >= 1 else 2)
    if gpus and n > gpus:
        raise BenchError(f"--nproc {n} is more than the {gpus} visible GPUs; use --nproc {gpus} or fewer")
    if n < 1:
        raise BenchError(f"--nproc must be >= 1, got {n}")
    # Pinning is for CPU runs only: on GPUs the cores' layout (NUMA) is the launcher's business.
    return Machine(
        gpus=gpus,
        cores=cores,
        nproc=n,
        threads_n=max(1, cores // n),
        threads_1=max(1, cores),
        comm="nccl" if gpus else "gloo",
        bind_cores=bind_cores and gpus == 0 and hasattr(os, "sched_setaffinity"),
    )


def lenet(batch: int, p: Preset, save: bool, threads: int | None = None) -> Case:
    return Case(
        model="lenet",
        batch=batch,
        image_size=32,
        warmup=p.lenet_warmup,
        steps=p.lenet_steps,
        lr=0.01,
        save_weights=save,
        threads=threads,
    )


def schedule(
    p: Preset,
    parts: list[str],
    models: list[str],
    machine: Machine,
    control: Sequence[str] = (),
    same_process: tuple[str, ...] = (),
) -> list[Job]:
    """Every launch, in order.  Within a round, the launches compared with
    each other (a backend's plain script, parallelx, and for the families in
    ``control`` the plain script again) are adjacent, and their order
    rotates every round (A B, B A; A B C, B C A, C A B), so that a slow spell
    of a noisy machine hits each alike.  Last, one same-process launch for
    each backend in ``same_process`` (LeNet: its batches alone give both
    implementations identical weights; VGG16's dropout would not)."""
    n = machine.nproc
    groups = [[f"raw-{f}", f"px-{f}", *([f"ctl-{f}"] if f in control else [])] for f in FAMILIES if f in parts]
    singles = [f"raw-{REFERENCE}", f"px-{REFERENCE}"] if "scaling" in parts and n > 1 else []
    if singles and p.scaling_all:
        singles += [f"{k}-{f}" for f in FAMILIES if f != REFERENCE and f in parts for k in ("raw", "px")]

    def cases(family: str, save: bool, with_vgg: bool, one_process: bool = False) -> list[Case]:
        batches = {*p.lenet_batches, p.lenet_batch} if family == REFERENCE or p.scaling_all else {p.lenet_batch}
        # A 1-process run measures two baselines in one launch: all the cores' threads (same hardware
        # as N processes), and the threads each of the N processes gets (same per-process resources).
        variants: list[int | None] = [None]
        if one_process and machine.threads_n != machine.threads_1:
            variants.append(machine.threads_n)
        out = [lenet(b, p, save, t) for b in sorted(batches) for t in variants] if "lenet" in models else []
        if with_vgg and (not one_process or p.scaling_all):
            out += [
                Case(
                    model="vgg16",
                    batch=p.vgg_batch,
                    image_size=p.image_size,
                    warmup=p.vgg_warmup,
                    steps=p.vgg_steps,
                    lr=0.001,
                    save_weights=save,
                    threads=t,
                )
                for t in variants
            ]
        return out

    jobs: list[Job] = []
    for r in range(p.repeats):
        save, with_vgg = r == 0, "vgg16" in models and r < p.vgg_repeats  # one set of final weights is enough
        for group in groups:
            for impl in group[r % len(group) :] + group[: r % len(group)]:
                jobs.append(
                    Job(
                        impl=impl,
                        nproc=n,
                        threads=machine.threads_n,
                        repeat=r,
                        cases=cases(IMPLS[impl].family, save, with_vgg),
                    )
                )
        for impl in singles if r % 2 == 0 else singles[::-1]:
            jobs.append(
                Job(
                    impl=impl,
                    nproc=1,
                    threads=machine.threads_1,
                    repeat=r,
                    cases=cases(IMPLS[impl].family, save, with_vgg, one_process=True),
                )
            )
    if "lenet" in models and n > 1:
        case = replace(lenet(p.lenet_batch, p, False), warmup=2, steps=p.same_steps)
        jobs += [
            Job(
                impl=f"same-{f}",
                nproc=n,
                threads=machine.threads_n,
                cases=[case],
                repeat=0,
                extra_args=("--blocks", str(p.same_blocks)),
            )
            for f in same_process
        ]
    return [j for j in jobs if j.cases]
