"""What sharding saves: each rank's memory through set-up and training, under
ddp, DeepSpeed ZeRO 1-3 and fsdp, beside what ``python -m parallelx estimate``
predicts for it.

    python -m benchmarks.memory --model gpt-200m --nproc 2 4 --cases ddp fsdp zero3   # the big-models table
    python -m benchmarks.memory --nproc 2 4 --image-size 32 --steps 3                 # VGG16, SGD (docs/sharding.md)
    python -m benchmarks.memory --tiny                                                # LeNet, 2 processes: a smoke test

Each case is one launch under the backend's own launcher.  The GPT models
(``gpt-200m``: 16 blocks of width 1024, 202 M parameters, 771 MiB of float32
weights; ``gpt-20m``; ``gpt-recipe``: ``recipes/gpt.py``'s defaults) train with
AdamW on random tokens, VGG16 and LeNet with SGD and momentum on synthetic
images.  Every rank reports:

- its peak RSS growth (CPU; ``VmHWM`` over the RSS after the backend joined its
  world, reset there) or ``max_memory_allocated`` (GPU), cumulative through each
  phase: building the model, ``backend.setup``, one optimizer step (``--steps``
  more for the image models);
- params, grads, optimizer: the bytes of this rank's own tensors (a DTensor's
  local shard, a ZeRO-3 partition), after the last backward;
- model state: the bytes of every tensor alive in Python but the input batches
  (tensors held only by C++, DDP's gradient buckets, are not seen);
- the median step time, as a ratio to ddp's at the same world size, and the minor page faults of
  each step after the first (median; ``getrusage``): what an allocator setting costs a step,
  counted, so it reads the same on a loaded machine (``--steps 4`` for the GPT models).

The table goes to stdout and ``--out`` (JSON), with the estimate's held bytes
and peak beside the measurement.  Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import parallelx
from benchmarks.workload import Case, build_model, make_optimizer, synthetic_batches
from parallelx.bigmodels import estimate
from parallelx.launching import runner

#: name -> (backend, extra arguments, the estimate's row)
CASES: dict[str, tuple[str, list[str], str]] = {
    "ddp": ("ddp", [], "ddp"),
    **{f"zero{z}": ("deepspeed", ["--zero-stage", str(z)], f"deepspeed zero{z}") for z in (1, 2, 3)},
    # DeepSpeed's default reduce bucket (5e8 elements, 1.9 GiB in float32) is held by every ZeRO-3 rank.
    "zero3-bucket5e7": (
        "deepspeed",
        ["--zero-stage", "3", "--deepspeed-config", "{work}/bucket5e7.json"],
        "deepspeed zero3",
    ),
    "fsdp": ("fsdp", [], "fsdp"),
    # Hybrid sharding: 2 replicas, each sharded over half the ranks (fsdp's row at half the world).
    "hsdp": ("fsdp", ["--fsdp-replicate", "2"], "fsdp"),
}
#: The cases that shard over a part of the world: their replicas.
REPLICAS = {"hsdp": 2}
#: Configs the cases above name, written into the work folder.
CONFIGS = {"bucket5e7.json": {"zero_optimization": {"reduce_bucket_size": 50_000_000}}}
IMAGE_MODELS = ("vgg16", "lenet")
GPT_MODELS = ("gpt-200m", "gpt-200m-vocab", "gpt-200m-untied", "gpt-20m", "gpt-recipe")
#: The phases each rank reports its peak through, in order.
PHASES = ("build", "setup", "step")


# ------------------------------------------------------------ the models
def _gpt(n_layer: int, n_embd: int, vocab_size: int = 256, block_size: int = 256) -> nn.Module:
    from recipes.models import GPT, GPTConfig

    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=max(1, n_embd // 64),
            n_embd=n_embd,
            dropout=0.0,
        )
    )


def gpt_200m() -> nn.Module:
    """202 M parameters (771 MiB in float32): 16 blocks of width 1024, 256 tokens."""
    return _gpt(16, 1024)


def gpt_200m_vocab() -> nn.Module:
    """203 M parameters with GPT-2's vocabulary (50,304 tokens, its embedding tied to the output: 197 MiB,
    a quarter of the model): 12 blocks of width 1024.  The largest single tensor, for set-up's peak."""
    return _gpt(12, 1024, vocab_size=50304)


def gpt_200m_untied() -> nn.Module:
    """204 M parameters: GPT-2's vocabulary with an output layer of its own (as Llama's), two tensors of
    197 MiB, the first and the last made; 8 blocks of width 1024."""
    model = _gpt(8, 1024, vocab_size=50304)
    head = model.lm_head  # type: ignore[union-attr]
    head.weight = nn.Parameter(torch.empty_like(head.weight))
    nn.init.normal_(head.weight, std=0.02)
    return model


def gpt_20m() -> nn.Module:
    """19 M parameters: 6 blocks of width 512 (the tests' size: it stands out of the RSS noise)."""
    return _gpt(6, 512)


def gpt_recipe() -> nn.Module:
    """``recipes/gpt.py``'s model with its defaults (32 characters, 4 blocks of width 96)."""
    from recipes.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=32))


def llama_7b() -> nn.Module:
    """A Llama-2-7B-shaped model from transformers' ``LlamaConfig`` (6.74 B parameters): for
    ``python -m parallelx estimate benchmarks.memory:llama_7b`` (built on the meta device there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config)


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "gpt-200m": gpt_200m,
    "gpt-200m-vocab": gpt_200m_vocab,
    "gpt-200m-untied": gpt_200m_untied,
    "gpt-20m": gpt_20m,
    "gpt-recipe": gpt_recipe,
}


# ------------------------------------------------------------ measuring
def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's shard, a ZeRO-3 parameter's partition."""
    if hasattr(t, "to_local"):
        return t.to_local()
    return getattr(t, "ds_tensor", t)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def live_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of the distinct storages of every live tensor, but those in ``exclude`` (data_ptrs)."""
    seen, total = set(exclude), 0
    for obj in gc.get_objects():
        try:
            t = _local(obj) if torch.is_tensor(obj) else None
        except Exception:  # a half-built object
            continue
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """This rank's optimizer state (DeepSpeed's wrapper hands out its inner optimizer's)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    inner = getattr(inner, "optimizer", inner)  # ZeRO's wrapper around the torch optimizer
    return _bytes(_local(v) for state in inner.state.values() for v in state.values() if torch.is_tensor(v))


class Peak:
    """This process's memory high-water mark over a base: ``VmHWM`` reset at the base on the CPU
    (``/proc/self/clear_refs``), ``max_memory_allocated`` on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        else:
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = self._status("VmRSS")

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    @property
    def kind(self) -> str:
        return "max_memory_allocated" if self.device.type == "cuda" else "peak RSS growth"

    def growth(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self._status("VmHWM") - self.base


def worker(args: argparse.Namespace) -> int:
    backend = parallelx.from_args(args)
    with backend:
        peak = Peak(backend.device)
        phases: dict[str, int] = {}
        torch.manual_seed(0)
        if args.model in FACTORIES:
            building = {"meta": parallelx.init_module, "plain": lambda: torch.device("meta")}
            with building.get(args.build, contextlib.nullcontext)():
                model = FACTORIES[args.model]()
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            g = torch.Generator().manual_seed(backend.rank)
            vocab = model.lm_head.out_features
            tokens = torch.randint(0, vocab, (args.batch, args.block + 1), generator=g).to(backend.device)
            batches = [(tokens[:, :-1], tokens[:, 1:])]
            steps = args.steps

            def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        else:
            case = Case(
                model=args.model, batch=args.batch, image_size=args.image_size, warmup=1, steps=args.steps, lr=0.01
            )
            model = build_model(case)
            optimizer = make_optimizer(model, case)
            batches = synthetic_batches(case, backend.rank, backend.device)
            steps = case.warmup + case.steps

            def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return nn.functional.cross_entropy(model(x), y)

        phases["build"] = peak.growth()
        model, optimizer = backend.setup(model, optimizer)
        phases["setup"] = peak.growth()
        data = {t.untyped_storage().data_ptr() for b in batches for t in b}
        times, faults, held = [], [], {}
        for i in range(steps):
            x, y = batches[i % len(batches)]
            faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            with backend.autocast():
                loss = loss_of(x, y)
            backend.backward(loss)
            if i == steps - 1:  # gradients and optimizer state both alive (the state from the step before)
                params = list(model.parameters())
                held = {
                    "params": _bytes(_local(p) for p in params),
                    "grads": _bytes(_local(p.grad) for p in params if p.grad is not None),
                }
            backend.step(optimizer)
            if i == 0:
                phases["step"] = peak.growth()
            if i >= min(1, steps - 1):
                times.append(time.perf_counter() - start)
            if i >= 1:
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
        held["optimizer"] = optimizer_state_bytes(optimizer)
        held["model_state"] = live_tensor_bytes(data)
        report = {
            **held,
            "phases": phases,
            "peak": peak.growth(),
            "peak_kind": peak.kind,
            "step_s": statistics.median(times),
            "faults_per_step": statistics.median(faults) if faults else None,
            "world_size": backend.world_size,
            "comm": dist.get_backend() if dist.is_initialized() else None,
        }
        rows = backend.all_gather_object(report)
        if backend.is_main():
            Path(args.out).write_text(json.dumps(rows))
    return 0


# ------------------------------------------------------------ the runs
def run_case(name: str, nproc: int, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    backend, extra, _ = CASES[name]
    for file, config in CONFIGS.items():
        (work / file).write_text(json.dumps(config))
    extra = [a.format(work=work) for a in extra]
    out = work / f"{name}-n{nproc}.json"
    target = [
        "-m",
        "benchmarks.memory",
        "--worker",
        "--backend",
        backend,
        *extra,
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--block",
        str(args.block),
        "--image-size",
        str(args.image_size),
        "--steps",
        str(args.steps),
        "--build",
        args.build,
        "--out",
        str(out),
        *(["--precision", args.precision] if args.precision else []),
    ]
    done = runner.launch(
        parallelx.describe(backend).launcher,
        target,
        nproc,
        timeout=args.launch_timeout,
        cwd=Path(__file__).resolve().parents[1],
        env={"OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0 or not out.is_file():
        print(
            f"{name} n={nproc}: failed (exit {done.returncode}):\n" + "\n".join(done.output.splitlines()[-15:]),
            file=sys.stderr,
        )
        return []
    return json.loads(out.read_text())


def sharded_over(name: str, nproc: int) -> int:
    """The ranks that case ``name`` shards over at ``nproc`` processes (0: it cannot run there)."""
    replicas = REPLICAS.get(name, 1)
    return 0 if nproc % replicas else nproc // replicas


def estimates(args: argparse.Namespace, nprocs: list[int]) -> dict[str, dict[int, estimate.RankMemory]]:
    """The estimate's row for each case and world size (GPT models: AdamW; image models: SGD with momentum)."""
    if args.model in FACTORIES:
        with torch.device("meta"):
            model = FACTORIES[args.model]()
        training = estimate.Training(
            optimizer="adamw", precision=args.precision or "32", build="eager" if args.build == "eager" else "meta"
        )
    else:
        with torch.device("meta"):
            model = build_model(
                Case(model=args.model, batch=args.batch, image_size=args.image_size, warmup=0, steps=1, lr=0.01)
            )
        training = estimate.Training(optimizer="sgd-momentum", precision=args.precision or "32")
    counts = estimate.count_model(model)
    out: dict[str, dict[int, estimate.RankMemory]] = {}
    for name, (backend, _, row) in CASES.items():
        cls = parallelx.backend_class(backend)
        for n in nprocs:
            shards = sharded_over(name, n)
            if not shards:
                continue
            found = [r for r in cls.estimate_memory(counts, shards, training) if r.backend == row]
            if found:
                out.setdefault(name, {})[n] = found[0]
    return out


def table(results: dict[str, dict[int, list[dict[str, Any]]]], predicted: dict[str, dict[int, Any]]) -> str:
    mib = 2**20
    lines = [
        "| case | processes | params / rank | grads / rank | optimizer / rank | model state / rank | "
        "building | set-up | after a step | vs ddp | estimate: held, peak | step time vs ddp | page faults / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_n in results.items():
        for n, rows in sorted(by_n.items()):
            if not rows:
                lines.append(f"| {name} | {n} | failed |" + " |" * 11)
                continue
            ddp = results.get("ddp", {}).get(n) or rows
            worst = max(rows, key=lambda r: r["peak"])
            phase = {p: max(r["phases"][p] for r in rows) for p in PHASES}
            ddp_step = max(r["phases"]["step"] for r in ddp)
            speed = statistics.mean(r["step_s"] for r in rows) / statistics.mean(r["step_s"] for r in ddp)
            guess = predicted.get(name, {}).get(n)
            est = f"{guess.steady / mib:.0f}, {guess.peak / mib:.0f} MiB" if guess else "-"
            counted = [r["faults_per_step"] for r in rows if r.get("faults_per_step") is not None]
            faults = f"{max(counted):,.0f}" if counted else "-"
            lines.append(
                f"| {name} | {n} | {worst['params'] / mib:.0f} MiB | {worst['grads'] / mib:.0f} MiB | "
                f"{worst['optimizer'] / mib:.0f} MiB | {worst['model_state'] / mib:.0f} MiB | "
                f"{phase['build'] / mib:.0f} MiB | {phase['setup'] / mib:.0f} MiB | {phase['step'] / mib:.0f} MiB | "
                f"{phase['step'] / ddp_step:.2f} | {est} | {speed:.2f} | {faults} |"
            )
    kind = next((r["peak_kind"] for by_n in results.values() for rows in by_n.values() for r in rows), "peak")
    return "\n".join(lines) + f"\n\nbuilding, set-up, after a step: the largest rank's {kind}, cumulative.\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parallelx.add_arguments(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=None, help="default: all (GPT: ddp fsdp zero3)")
    p.add_argument("--model", choices=(*IMAGE_MODELS, *GPT_MODELS), default="vgg16")
    p.add_argument("--batch", type=int, default=2, help="images or sequences per process per step")
    p.add_argument("--block", type=int, default=64, help="tokens per sequence (GPT models)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="image models: timed steps after one untimed (default 3); GPT models: steps in all, the first "
        "one's peak the table's 'after a step' (default 1; more count the page faults of the later ones)",
    )
    p.add_argument(
        "--build",
        choices=("eager", "meta", "plain"),
        default="eager",
        help="GPT models: built whole on every rank (eager), under parallelx.init_module() (meta), or under "
        "torch.device('meta'), the modules' reset_parameters() giving the values (plain)",
    )
    p.add_argument("--launch-timeout", type=float, default=600, help="seconds per launch")
    p.add_argument("--tiny", action="store_true", help="LeNet, 2 processes, ddp and fsdp, 1 step: a smoke test")
    p.add_argument("--out", default=None, help="the JSON results (worker: its rows)")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.tiny:
        args.model, args.nproc, args.cases, args.steps = "lenet", [2], ["ddp", "fsdp"], 1
    if args.steps is None:
        args.steps = 1 if args.model in FACTORIES else 3
    if args.cases is None:
        args.cases = ["ddp", "fsdp", "zero3"] if args.model in FACTORIES else list(CASES)
    predicted = estimates(args, args.nproc)
    with tempfile.TemporaryDirectory() as work:
        results = {
            name: {n: run_case(name, n, args, Path(work)) for n in args.nproc if sharded_over(name, n) > 1}
            for name in args.cases
        }
    print(table(results, predicted), end="")
    if args.out:
        dumped = {n: {str(k): dataclasses_dict(v) for k, v in by_n.items()} for n, by_n in predicted.items()}
        Path(args.out).write_text(json.dumps({"results": results, "estimates": dumped}, indent=1))
    return 0 if all(rows for by_n in results.values() for rows in by_n.values()) else 1


def dataclasses_dict(row: estimate.RankMemory) -> dict[str, Any]:
    import dataclasses

    return {**dataclasses.asdict(row), "steady": row.steady, "peak": row.peak}


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
