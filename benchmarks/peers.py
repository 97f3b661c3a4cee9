"""The same training job written four ways, side by side: raw PyTorch, parallelx, HuggingFace
Accelerate and Lightning Fabric, in DDP and in FSDP2 mode, 2 processes on the CPU under torchrun.

    pip install accelerate==1.16.0 lightning==2.6.6   # the peers, for this benchmark only (the versions measured)
    python -m benchmarks.peers                        # 3 rounds, ddp and fsdp, every implementation installed
    python -m benchmarks.peers --modes fsdp --impls raw,parallelx,fabric --rounds 5
    python -m benchmarks.peers --quick                # a tiny GPT, 1 round: a smoke test

The job: a GPT as nanoGPT builds it (4 pre-LN blocks of width 256, 4 heads, context 128, a
vocabulary of 256, no dropout, the output layer tied to the token embedding), AdamW with
nanoGPT's two groups (the 2-D tensors decay, the biases and LayerNorm weights do not), float32,
16 sequences per rank per step, each rank its own batches (a pool of 8, cycled: walks of a fixed
random successor table, which the model learns), the same
seeded initial weights everywhere.  The model is defined here, not imported from the recipes,
so that no implementation but parallelx's imports parallelx (its start-up time would count it).

| mode | raw PyTorch | parallelx | Accelerate | Fabric |
|---|---|---|---|---|
| ddp | ``DistributedDataParallel`` | ``get_backend("ddp")`` | ``Accelerator(cpu=True)`` | ``DDPStrategy`` |
| fsdp | ``fully_shard`` per block, then the root | ``get_backend("fsdp")`` | its FSDP2 plugin, per block | ``ModelParallelStrategy``, ``fully_shard`` per block, then the root |

Each implementation runs in launches of its own (torchrun, gloo, every process on its own
cores): ``--warmup`` untimed steps, then ``--steps`` timed ones (forward, loss, backward,
optimizer step, zeroed gradients).  Rounds alternate the implementations, their order rotating
every round, so that a slow spell of the machine falls on each alike.  Before any time is
reported, every rank's loss sequence (warm-up included) must equal, bit for bit, that of the raw
engine of its mode (raw DDP, raw FSDP2) in every round; one that differs is shown with its
difference and no time (``--loss-atol`` admits a stated floor instead).  Printed per
implementation: rank 0's median step time per round, the ratio against its raw engine (pooled
medians) with the range of the rounds' own ratios, start-up time (the process's start to the
first step: interpreter, imports, process group, model, wrapping; rank 0, median over the
rounds) and each rank's peak RSS (``VmHWM``: the whole process, imports included).  Where a
peer cannot run a mode (or is not installed), the table says so with the peer's own error and
goes on.  The exit status is 1 when a loss sequence differs or raw PyTorch or parallelx failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Nothing heavy at module level: the workers import only what their implementation needs, so
# that each one's start-up time is its own.

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("raw", "parallelx", "accelerate", "fabric")
#: The modes, and whether each shards (FSDP2) or replicates (DDP) the model.
SHARDS = {"ddp": False, "fsdp": True}
MODES = tuple(SHARDS)
#: The peers' packages (import name, distribution, the version measured).
PEERS = {"accelerate": ("accelerate", "accelerate", "1.16.0"), "fabric": ("lightning.fabric", "lightning", "2.6.6")}
INSTALL = "pip install " + " ".join(f"{dist}=={ver}" for _, dist, ver in PEERS.values())
LABELS = {
    ("raw", "ddp"): "raw DDP",
    ("parallelx", "ddp"): "parallelx ddp",
    ("accelerate", "ddp"): "Accelerate (DDP)",
    ("fabric", "ddp"): "Fabric (DDP)",
    ("raw", "fsdp"): "raw FSDP2 (`fully_shard` per block, then the root)",
    ("parallelx", "fsdp"): "parallelx fsdp",
    ("accelerate", "fsdp"): "Accelerate (FSDP2 plugin)",
    ("fabric", "fsdp"): "Fabric (FSDP2, `ModelParallelStrategy`)",
}
#: Distinct batches per rank, cycled: the model learns them, so the losses move.
POOL = 8
#: How much ``--perturb`` changes one implementation's learning rate: far below anything a
#: benchmark's figures could show, enough to change the losses' bits from the second step on.
PERTURB = 1e-6


@dataclass(frozen=True)
class Size:
    """The job's model and schedule."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    block: int = 128  # the context
    vocab: int = 256
    batch: int = 16  # sequences per rank per step
    warmup: int = 10
    steps: int = 60
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 1337


FULL = Size()
QUICK = Size(n_layer=2, n_embd=64, n_head=2, block=32, batch=4, warmup=2, steps=4)


@dataclass(frozen=True)
class Machine:
    nproc: int
    threads_n: int  # torch threads per process
    bind_cores: bool  # each process pinned to its own cores


# ------------------------------------------------------------------ the job
def build_gpt(size: Size) -> Any:
    """nanoGPT's GPT (the recipe's, ``recipes.models.GPT``, without dropout), seeded."""
    import math

    import torch
    from torch import nn
    from torch.nn import functional as F

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(size.n_embd, 3 * size.n_embd)
            self.c_proj = nn.Linear(size.n_embd, size.n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape
            q, k, v = (
                t.view(B, T, size.n_head, C // size.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_fc, self.gelu = nn.Linear(size.n_embd, 4 * size.n_embd), nn.GELU()
            self.c_proj = nn.Linear(4 * size.n_embd, size.n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.attn = nn.LayerNorm(size.n_embd), Attention()
            self.ln_2 = nn.LayerNorm(size.n_embd)
            self.mlp = MLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict(
                {
                    "wte": nn.Embedding(size.vocab, size.n_embd),
                    "wpe": nn.Embedding(size.block, size.n_embd),
                    "h": nn.ModuleList([Block() for _ in range(size.n_layer)]),
                    "ln_f": nn.LayerNorm(size.n_embd),
                }
            )
            self.lm_head = nn.Linear(size.n_embd, size.vocab, bias=False)
            self.transformer["wte"].weight = self.lm_head.weight  # tied
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    # GPT-2's scaled init of the residual projections (attention's and the MLP's).
                    std = 0.02 / math.sqrt(2 * size.n_layer) if name.endswith("c_proj.weight") else 0.02
                    nn.init.normal_(p, 0.0, std)
                elif not name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                    nn.init.zeros_(p)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            t: Any = self.transformer
            x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in t.h:
                x = block(x)
            return self.lm_head(t.ln_f(x))

    torch.manual_seed(size.seed)
    return GPT()


def param_groups(model: Any, size: Size) -> list[dict[str, Any]]:
    """nanoGPT's AdamW groups: the 2-D tensors (the tied one once) decay, the rest do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": size.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(params: Any, size: Size, perturbed: bool) -> Any:
    import torch

    lr = size.lr * (1 + PERTURB) if perturbed else size.lr
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))


def batches(size: Size, rank: int) -> list[tuple[Any, Any]]:
    """This rank's pool of (input, target) batches: walks of a fixed random successor table from
    random starts, which the model can learn (its loss falls from the first steps; on uniform
    random tokens it would stay at log(vocab) and say little about the training)."""
    import torch

    successor = torch.randperm(size.vocab, generator=torch.Generator().manual_seed(size.seed))
    g = torch.Generator().manual_seed(size.seed + 1 + rank)
    out = []
    for _ in range(POOL):
        seq = torch.empty(size.batch, size.block + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, size.vocab, (size.batch,), generator=g)
        for t in range(size.block):
            seq[:, t + 1] = successor[seq[:, t]]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def loss_of(model: Any, x: Any, y: Any) -> Any:
    from torch.nn import functional as F

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def shard_blocks(model: Any, mesh: Any) -> Any:
    """Raw FSDP2 as its documentation writes it: ``fully_shard`` on each block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


# ------------------------------------------------- the four implementations
class Impl:
    """One implementation's set-up (``__init__``: process group, model, optimizer), its step and its end."""

    model: Any
    opt: Any

    def __init__(self, mode: str, size: Size, perturbed: bool) -> None:
        raise NotImplementedError

    def step(self, x: Any, y: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Raw(Impl):
    def __init__(self, mode: str, size: Size, perturbed: bool) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        model = build_gpt(size)
        if not SHARDS[mode]:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            self.model = shard_blocks(model, init_device_mesh("cpu", (dist.get_world_size(),)))
        # FSDP2's parameters are new objects: the optimizer is built on them, after sharding.
        self.opt = adamw(param_groups(model, size), size, perturbed)

    def step(self, x: Any, y: Any) -> Any:
        loss = loss_of(self.model, x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class Parallelx(Impl):
    def __init__(self, mode: str, size: Size, perturbed: bool) -> None:
        import parallelx

        self.backend = parallelx.get_backend(mode, device="cpu").init()
        model = build_gpt(size)
        self.model, self.opt = self.backend.setup(model, adamw(param_groups(model, size), size, perturbed))

    def step(self, x: Any, y: Any) -> Any:
        loss = loss_of(self.model, x, y)
        self.backend.backward(loss)
        self.backend.step(self.opt)
        return loss

    def close(self) -> None:
        self.backend.shutdown()


class PeerCannot(Exception):
    """A peer that does not run a mode without raising: what it did instead."""


class Accelerate(Impl):
    def __init__(self, mode: str, size: Size, perturbed: bool) -> None:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import FSDPModule

        plugin = None
        if SHARDS[mode]:
            plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"]
            )
        self.accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        model = build_gpt(size)
        self.model, self.opt = self.accelerator.prepare(model, adamw(param_groups(model, size), size, perturbed))
        if SHARDS[mode] and not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            # Accelerate keeps its FSDP plugin for its GPU-like devices; on the CPU it drops it without a word.
            raise PeerCannot(
                f"given FullyShardedDataParallelPlugin(fsdp_version=2), Accelerator(cpu=True) chose distributed_type "
                f"{self.accelerator.distributed_type.value} and prepare() returned a {type(self.model).__name__}, "
                "no fully_shard: Accelerate ignores its FSDP plugin on the CPU"
            )

    def step(self, x: Any, y: Any) -> Any:
        loss = loss_of(self.model, x, y)
        self.accelerator.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class Fabric(Impl):
    def __init__(self, mode: str, size: Size, perturbed: bool) -> None:
        from lightning.fabric import Fabric as LightningFabric
        from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy

        nproc = int(os.environ["LOCAL_WORLD_SIZE"])
        if not SHARDS[mode]:
            strategy: Any = DDPStrategy()
        else:
            strategy = ModelParallelStrategy(
                lambda m, mesh: shard_blocks(m, mesh["data_parallel"]),
                data_parallel_size=nproc,
                tensor_parallel_size=1,
            )
        self.fabric = LightningFabric(accelerator="cpu", devices=nproc, strategy=strategy, precision="32-true")
        self.fabric.launch()
        model = build_gpt(size)
        if not SHARDS[mode]:
            self.model, self.opt = self.fabric.setup(model, adamw(param_groups(model, size), size, perturbed))
        else:  # ModelParallelStrategy sets the module up first; the optimizer follows on its sharded parameters
            self.model = self.fabric.setup_module(model)
            self.opt = self.fabric.setup_optimizers(adamw(param_groups(self.model, size), size, perturbed))

    def step(self, x: Any, y: Any) -> Any:
        loss = loss_of(self.model, x, y)
        self.fabric.backward(loss)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


BUILDERS: dict[str, type[Impl]] = {"raw": Raw, "parallelx": Parallelx, "accelerate": Accelerate, "fabric": Fabric}


# --------------------------------------------------------------- the worker
def process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start in clock ticks since boot)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def vmhwm_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def pin(threads: int, local_rank: int) -> list[int] | None:
    """Local rank r on the r-th block of ``threads`` cores (as ``benchmarks.run`` pins), if there are enough."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    block = cores[local_rank * threads : (local_rank + 1) * threads]
    if len(block) < threads:
        return None
    os.sched_setaffinity(0, block)
    return block


def first_line(exc: BaseException) -> str:
    """The exception as the peer put it: its type and its first line (a PeerCannot: what the peer did)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return first if isinstance(exc, PeerCannot) else f"{type(exc).__name__}: {first}".rstrip(": ")


def worker(args: argparse.Namespace) -> int:
    age = process_age_s()
    started = time.time() - (age if age is not None else 0.0)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cores = pin(args.threads, local_rank) if args.bind else None
    size = Size(**json.loads(args.size))
    out = Path(args.out_prefix + f".rank{rank}.json")
    result: dict[str, Any] = {"impl": args.impl, "mode": args.mode, "rank": rank, "cores": cores}
    result["start_known"] = age is not None
    try:
        impl = BUILDERS[args.impl](args.mode, size, args.perturbed)
    except Exception as exc:  # the peer's own error, said in the table; the benchmark goes on
        result["error"] = first_line(exc)
        out.write_text(json.dumps(result))
        raise
    import torch

    torch.set_num_threads(args.threads)  # after the set-up: a framework may have changed it
    from torch.distributed.fsdp import FSDPModule

    result["sharded_units"] = sum(isinstance(m, FSDPModule) for m in impl.model.modules())
    result["imported_parallelx"] = "parallelx" in sys.modules
    data = batches(size, rank)
    times, losses = [], []
    result["startup_s"] = time.time() - started
    for i in range(size.warmup + size.steps):
        x, y = data[i % POOL]
        begin = time.perf_counter()
        loss = impl.step(x, y)
        times.append(time.perf_counter() - begin)
        losses.append(loss.detach())
    result.update(
        threads=torch.get_num_threads(),
        step_times_s=times[size.warmup :],
        losses=[float(v) for v in losses],  # float32 values: exact as Python floats
        peak_rss_mib=vmhwm_mib(),
    )
    impl.close()
    out.write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------- the orchestrator
def peer_missing(impl: str) -> str | None:
    """Why ``impl`` cannot be imported here (None when it can), without importing it."""
    import importlib.util

    if impl not in PEERS:
        return None
    module, dist, _ = PEERS[impl]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{dist} is not installed ({INSTALL}: the versions measured)"


def installed_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    from parallelx.launching import envreport

    out = {k: v for k, v in envreport.versions().items() if k in ("python", "torch", "parallelx")}
    for _, dist, _ in PEERS.values():
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def launch_one(
    impl: str, mode: str, rnd: int, size: Size, args: argparse.Namespace, machine: Any, work: Path
) -> dict[str, Any]:
    """One launch of ``impl`` in ``mode``: every rank's result, or the error that stopped it."""
    import parallelx
    from parallelx.launching import runner

    prefix = work / f"{impl}-{mode}-r{rnd}"
    target = [
        "-m",
        "benchmarks.peers",
        "--worker",
        *("--impl", impl, "--mode", mode, "--size", json.dumps(asdict(size))),
        *("--threads", str(machine.threads_n), "--out-prefix", str(prefix)),
        *(["--bind"] if machine.bind_cores else []),
        *(["--perturbed"] if f"{impl}:{mode}" in args.perturb else []),
    ]
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(machine.threads_n),
        "MKL_NUM_THREADS": str(machine.threads_n),
    }
    print(f"[peers] round {rnd + 1}: {LABELS[impl, mode]}", flush=True)
    done = runner.launch(
        parallelx.describe("ddp").launcher,
        target,
        machine.nproc,
        timeout=args.timeout,
        env=env,
        cwd=ROOT,
        log=work / f"{prefix.name}.log",
        die_with_parent=True,
    )
    ranks = [json.loads(p.read_text()) for r in range(machine.nproc) if (p := Path(f"{prefix}.rank{r}.json")).is_file()]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"error": errors[0], "cannot": True}
    if done.error() is not None or len(ranks) != machine.nproc:
        why = done.error() or f"{len(ranks)} of {machine.nproc} ranks wrote results"
        return {"error": f"{why} (log {work / (prefix.name + '.log')}):\n{done.tail(15)}", "cannot": False}
    return {"ranks": sorted(ranks, key=lambda r: r["rank"])}


def compare_losses(a: list[list[float]], b: list[list[float]], atol: float) -> dict[str, Any]:
    """Every rank's loss sequence ``a`` against ``b``: bitwise equal, or the largest difference and its first step."""
    diffs = [(abs(x - y), s) for ra, rb in zip(a, b) for s, (x, y) in enumerate(zip(ra, rb))]
    worst = max((d for d, _ in diffs), default=0.0)
    first = min((s for d, s in diffs if d > 0), default=None)
    same_shape = len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b))
    return {
        "identical": same_shape and first is None,
        "max_abs_diff": worst if same_shape else float("inf"),
        "first_step": first,
        "passed": same_shape and worst <= atol,
    }


def analyse(runs: dict[tuple[str, str], list[dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (mode, implementation): its rounds, the loss check against its raw engine, the ratio."""
    import statistics

    from benchmarks import stats

    rows = []
    for mode in args.mode_list:
        ref = runs.get(("raw", mode), [])
        ref_losses = next((r["ranks"] for r in ref if "ranks" in r), None)
        raw_row = None
        for impl in args.impl_list:
            launches = runs.get((impl, mode), [])
            row: dict[str, Any] = {"impl": impl, "mode": mode, "label": LABELS[impl, mode]}
            if impl in args.skipped:
                row["skipped"] = args.skipped[impl]
                rows.append(row)
                continue
            failed = next((r for r in launches if "error" in r), None)
            good = [r for r in launches if "ranks" in r]
            if failed is not None or not good:
                row["error"] = failed["error"] if failed else "no launch"
                row["cannot"] = bool(failed and failed["cannot"])
                rows.append(row)
                continue
            if ref_losses is None:
                row["losses"] = {"identical": False, "passed": False, "max_abs_diff": None, "first_step": None}
                row["losses"]["why"] = f"{LABELS['raw', mode]} has no losses to compare with"
            else:
                checks = [
                    compare_losses([r["losses"] for r in g["ranks"]], [r["losses"] for r in ref_losses], args.loss_atol)
                    for g in good
                ]
                row["losses"] = max(checks, key=lambda c: (not c["passed"], c["max_abs_diff"]))
            zero = [g["ranks"][0] for g in good]
            rounds = [i for i, r in enumerate(launches) if "ranks" in r]
            row.update(stats.timing(rounds, [z["step_times_s"] for z in zero]))
            row["round_median_s"] = [statistics.median(t) for t in row["round_step_times_s"]]
            row["startup_s"] = statistics.median(z["startup_s"] for z in zero)
            row["peak_rss_mib"] = [
                max(g["ranks"][r]["peak_rss_mib"] or 0.0 for g in good) for r in range(len(good[0]["ranks"]))
            ]
            row["threads"] = zero[0]["threads"]
            row["sharded_units"] = zero[0]["sharded_units"]
            row["imported_parallelx"] = zero[0]["imported_parallelx"]
            row["losses_first_last"] = [zero[0]["losses"][0], zero[0]["losses"][-1]]
            if impl == "raw":
                raw_row = row
            elif raw_row is not None and row["losses"]["passed"]:
                c = stats.compare(
                    row, raw_row, impl=impl, baseline="raw", how="launches", case_id=mode, nproc=len(zero)
                )
                row["ratio"], row["ratio_per_round"] = c["ratio"], c["per_round"]
            if not row["losses"]["passed"]:
                row.pop("round_step_times_s")  # no time is reported for a different computation
                for key in ("median_step_s", "p10_step_s", "round_median_s"):
                    row.pop(key)
            rows.append(row)
    return rows


def engines_agree(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> str | None:
    """Raw FSDP2's losses against raw DDP's, in words (None unless both ran): the two raw engines' own floor."""
    ddp, fsdp = ([r["ranks"] for r in runs.get(("raw", m), []) if "ranks" in r] for m in MODES)
    if not ddp or not fsdp:
        return None
    c = compare_losses([r["losses"] for r in fsdp[0]], [r["losses"] for r in ddp[0]], 0.0)
    if c["identical"]:
        return "raw FSDP2's losses are identical to raw DDP's, bit for bit"
    return f"raw FSDP2's losses differ from raw DDP's from step {c['first_step']} (max {c['max_abs_diff']:.1e})"


def table(rows: list[dict[str, Any]], rounds: int) -> str:
    head = " | ".join(f"round {r + 1}" for r in range(rounds))
    lines = [
        f"| implementation | {head} | against its raw engine (range over rounds) | start-up | peak RSS per rank | losses |",
        "|---|" + "---|" * rounds + "---|---|---|---|",
    ]
    blank = " |" * rounds
    for row in rows:
        label = row["label"]
        if "skipped" in row:
            lines.append(f"| {label} |{blank} not installed | | | {row['skipped']} |")
            continue
        if "error" in row:
            what = "cannot run here" if row["cannot"] else "failed"
            lines.append(f"| {label} |{blank} {what} | | | {row['error'].splitlines()[0]} |")
            continue
        losses = row["losses"]
        if losses["identical"]:
            check = "identical to raw's" if row["impl"] != "raw" else "the reference"
        elif losses["passed"]:
            check = f"within {losses['max_abs_diff']:.1e} of raw's"
        else:
            check = losses.get("why") or (
                f"**differ from raw's** from step {losses['first_step']} (max {losses['max_abs_diff']:.1e}): no time reported"
            )
        rss = " / ".join(f"{m:.0f}" for m in row["peak_rss_mib"]) + " MiB"
        if "round_median_s" not in row:
            lines.append(f"| {label} |{blank} - | {row['startup_s']:.1f} s | {rss} | {check} |")
            continue
        cells = {r: f"{1e3 * t:.1f} ms" for r, t in zip(row["rounds"], row["round_median_s"])}
        times = " | ".join(cells.get(r, "-") for r in range(rounds))
        ratio = "-"
        if "ratio" in row:
            lo, hi = min(row["ratio_per_round"]), max(row["ratio_per_round"])
            ratio = f"{row['ratio']:.2f} ({lo:.2f}-{hi:.2f})"
        lines.append(f"| {label} | {times} | {ratio} | {row['startup_s']:.1f} s | {rss} | {check} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, from %(default)s (raw always runs)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from %(default)s")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default: 3; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per launch (default: 60)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps before them (default: 10)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny GPT (2 blocks of width 64, context 32, batch 4), 2 + 4 steps, 1 round",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default: %(default)s)")
    p.add_argument(
        "--no-bind",
        dest="bind",
        action="store_false",
        help="leave the processes unpinned (default: each on its own cores)",
    )
    p.add_argument(
        "--loss-atol",
        type=float,
        default=0.0,
        help="largest loss difference from the raw engine's that still reports a time (default: 0, bitwise)",
    )
    p.add_argument(
        "--perturb",
        default="",
        metavar="IMPL[:MODE],...",
        help=f"change these implementations' learning rate (in MODE, or in every mode) by {PERTURB:g} of itself: "
        "the loss check must then refuse their times (the benchmark's own test)",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per launch (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="every figure and step time as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out-prefix", help=argparse.SUPPRESS)
    p.add_argument("--bind", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--perturbed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    lists = {}
    pairs = [f"{i}:{m}" for i in IMPLS for m in MODES]
    for option, given, valid in (
        ("--impls", args.impls, IMPLS),
        ("--modes", args.modes, MODES),
        ("--perturb", args.perturb, (*IMPLS, *pairs)),
    ):
        names = [x.strip() for x in given.split(",") if x.strip()]
        if bad := [x for x in names if x not in valid]:
            p.error(f"{option}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
        lists[option] = names
    impls = lists["--impls"]
    args.impl_list = [i for i in IMPLS if i in impls or i == "raw"]  # raw is every check's reference
    args.mode_list = lists["--modes"]
    args.perturb = sorted({p if ":" in p else f"{p}:{m}" for p in lists["--perturb"] for m in MODES} & set(pairs))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)  # imports nothing of parallelx's unless it runs parallelx
    from parallelx.cli import exit_on_error

    return exit_on_error(orchestrate)(args, argv)


def orchestrate(args: argparse.Namespace, argv: list[str] | None) -> int:
    import shlex
    import signal
    import tempfile

    from benchmarks import report
    from benchmarks.launch import on_sigterm, unavailable
    from benchmarks.workload import BenchError
    from parallelx.launching import envreport

    signal.signal(signal.SIGTERM, on_sigterm)  # a timeout from outside still ends the running launch
    if why := unavailable("ddp"):
        raise BenchError(f"torchrun cannot start the jobs here: {why}")
    base = QUICK if args.quick else FULL
    size = replace(base, **{k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None})
    rounds = args.rounds or (1 if args.quick else 3)
    # The CPU only, whatever GPUs there are: each process takes an equal share of this process's cores.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    machine = Machine(args.nproc, max(1, cores // args.nproc), args.bind and hasattr(os, "sched_setaffinity"))
    args.skipped = {i: why for i in args.impl_list if (why := peer_missing(i))}
    for impl, why in args.skipped.items():
        print(f"[peers] skipping {impl}: {why}", file=sys.stderr, flush=True)
    impls = [i for i in args.impl_list if i not in args.skipped]
    started, load_start = time.time(), os.getloadavg()
    print(
        f"[peers] {len(impls)} implementations x {len(args.mode_list)} modes x {rounds} rounds; {machine.nproc} "
        f"processes x {machine.threads_n} thread(s), {'pinned' if machine.bind_cores else 'not pinned'}; "
        f"{size.warmup} + {size.steps} steps",
        flush=True,
    )
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="parallelx-peers-") as tmp:
        for rnd in range(rounds):
            for mode in args.mode_list:
                order = impls[rnd % len(impls) :] + impls[: rnd % len(impls)]  # rotates every round
                for impl in order:
                    earlier = runs.setdefault((impl, mode), [])
                    if any(r.get("cannot") for r in earlier):
                        earlier.append({"error": earlier[0]["error"], "cannot": True})
                        continue  # the peer said it cannot: once is enough
                    done = launch_one(impl, mode, rnd, size, args, machine, Path(tmp))
                    if "error" in done:
                        print(f"[peers] {LABELS[impl, mode]}: {done['error']}", file=sys.stderr, flush=True)
                    earlier.append(done)
    rows = analyse(runs, args)
    meta = {
        "command": "python -m benchmarks.peers " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "wall_s": time.time() - started,
        "hardware": envreport.hardware(),
        "versions": installed_versions(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "size": asdict(size),
        "rounds": rounds,
        "processes": machine.nproc,
        "threads": machine.threads_n,
        "pinned": machine.bind_cores,
        "loss_atol": args.loss_atol,
        "perturbed": args.perturb,
    }
    meta["raw_fsdp_vs_ddp"] = engines_agree(runs)
    text = "\n".join(report.header(meta)) + "\n\n" + table(rows, rounds)
    if meta["raw_fsdp_vs_ddp"]:
        text += f"\n{meta['raw_fsdp_vs_ddp']}.\n"
    print(text, end="", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    differ = [r for r in rows if "losses" in r and not r["losses"]["passed"]]
    broken = [r for r in rows if r["impl"] in ("raw", "parallelx") and "error" in r]
    for r in differ:
        print(
            f"[peers] LOSSES DIFFER: {r['label']} against {LABELS['raw', r['mode']]}: no time reported", file=sys.stderr
        )
    return 1 if differ or broken else 0


if __name__ == "__main__":
    sys.exit(main())
