"""What activation checkpointing saves and costs: the GPT recipe's model on ddp
and fsdp, with and without ``activation_checkpointing`` (``auto``: the blocks).

    python -m benchmarks.activations                          # ddp and fsdp, 2 processes (2.5 min on 2 busy cores)
    python -m benchmarks.activations --backends ddp --n-embd 192  # a wider model (1.7 min)
    python -m benchmarks.activations --tiny                   # a smoke test

Each backend runs twice under its own launcher (torchrun), once without
checkpointing and once with ``auto``: separate processes, so that the peak of
one setting cannot hide the other's.  The model is ``GPT(GPTConfig(
vocab_size=32))`` (block 64, 4 layers, 4 heads, width 96, dropout 0.1, 0.46 M
parameters) with nanoGPT's AdamW groups, ``--batch`` sequences per process,
each rank its own batch, seeded as the recipe seeds.  Every rank measures, over
``--steps`` training steps:

- saved activations: the bytes held for the backward at the end of each
  forward (its peak: nothing saved is freed before the backward), each
  storage counted once.  That is every tensor the autograd graph saves
  (``torch.autograd.graph.saved_tensors_hooks``) but the weights, plus the
  inputs of the checkpointed blocks, which the non-reentrant checkpoint keeps
  to run them again (its own hooks replace the outer ones inside a block, so
  the blocks' activations are not saved at all).  During the backward one
  block's activations at a time come back; the peak RSS counts them;
- peak RSS growth: ``VmHWM`` (reset through ``/proc/self/clear_refs`` just
  before the first step) minus the RSS at that moment; it also holds the
  gradients and AdamW's state, the same in both settings;
- the final weights, written by rank 0 and compared between the two settings
  (dropout included: the checkpoint replays the random-number state).

The run with checkpointing then times it against a second copy of the model
without (a second backend in the same processes), in rounds that alternate a
block of steps of each, so that the machine's load drifts over both alike: the
median of the rounds' ratios, with its range.  The table goes to stdout and
``--out`` (JSON).  Nothing is asserted: a benchmark reports.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import parallelx
from benchmarks.launch import on_sigterm
from parallelx.launching import runner
from parallelx.transforms import activations

#: The settings compared, as ``get_backend(activation_checkpointing=...)`` takes them (True: ``auto``).
SETTINGS: dict[str, bool | None] = {"none": None, "auto": True}
MIB = 2**20


def _status_kib(key: str) -> int | None:
    try:
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_rss() -> tuple[int, str]:
    """Start a new peak: the RSS now in bytes, and how the peak will be read.
    Where the high-water mark cannot be reset, ``ru_maxrss`` still holds the
    process's whole past (imports, model building) and may hide the steps' peak."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return (_status_kib("VmRSS") or 0) * 1024, "VmHWM"
    except OSError:
        return (_status_kib("VmRSS") or 0) * 1024, "ru_maxrss"


def peak_rss(kind: str) -> int:
    if kind == "VmHWM" and (kib := _status_kib("VmHWM")) is not None:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_weight(t: torch.Tensor) -> bool:
    # A parameter or a view of one (Linear saves weight.t()); fsdp's gathered parameters are leaves too.
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


class SavedBytes:
    """Counts what one forward keeps for the backward; each storage once."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: set[int] = set()
        self.bytes = 0
        self.active = False
        self.blocks = 0
        for module in model.modules():
            if getattr(module, activations.MARK, False):
                module.register_forward_pre_hook(self._block_inputs)
                self.blocks += 1

    def _add(self, t: torch.Tensor) -> None:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self.seen and storage.nbytes():
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()

    def _block_inputs(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.active and torch.is_grad_enabled():
            for a in args:
                if torch.is_tensor(a):
                    self._add(a)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.active and not _is_weight(t):
            self._add(t)
        # detach: a saved output packed as itself would hold its own grad_fn (a cycle only gc frees)
        return t.detach()

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def forward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The loss, and the bytes saved for its backward."""
        self.seen.clear()
        self.bytes, self.active = 0, True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                loss = gpt_loss(model, x, y)
        finally:
            self.active = False
        return loss, self.bytes


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def build(backend: parallelx.Backend, config: Any, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from recipes.models import GPT, gpt_param_groups

    parallelx.seed_everything(seed)  # the same initial weights on every rank and in both settings
    model = GPT(config)
    optimizer = torch.optim.AdamW(gpt_param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.99))
    return backend.setup(model, optimizer)


def timed_steps(backend: parallelx.Backend, model: nn.Module, opt: Any, batch: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        backend.backward(gpt_loss(model, *batch))
        backend.step(opt)
        times.append(time.perf_counter() - start)
    return times


def worker(args: argparse.Namespace) -> int:
    from recipes.models import GPTConfig

    config = GPTConfig(
        vocab_size=32,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    with parallelx.get_backend(args.backend, activation_checkpointing=SETTINGS[args.setting]) as backend:
        model, opt = build(backend, config, args.seed)
        torch.manual_seed(args.seed + 1000 * backend.rank)  # each rank's dropout masks, as the recipe draws them
        g = torch.Generator().manual_seed(args.seed + backend.rank)
        seq = torch.randint(0, config.vocab_size, (args.batch, config.block_size + 1), generator=g)
        batch = (seq[:, :-1].to(backend.device), seq[:, 1:].to(backend.device))
        meter = SavedBytes(model)
        base, kind = reset_peak_rss()
        saved, times = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            loss, nbytes = meter.forward(model, *batch)
            backend.backward(loss)
            backend.step(opt)
            times.append(time.perf_counter() - start)
            saved.append(nbytes)
        peak = peak_rss(kind)
        state = backend.model_state_dict(model)  # a collective under fsdp
        report: dict[str, Any] = {
            "rank": backend.rank,
            "world_size": backend.world_size,
            "setting": args.setting,
            "checkpointed_blocks": meter.blocks,
            "saved_bytes": max(saved),
            "rss_before": base,
            "rss_growth": peak - base,
            "rss_kind": kind,
            "step_s": statistics.median(times),
            "loss": float(loss),
        }
        if args.pair:
            report.update(pair_times(backend, config, model, opt, batch, args))
        rows = backend.all_gather_object(report)
        if backend.is_main():
            torch.save(state, Path(args.out).with_suffix(".pt"))
            Path(args.out).write_text(json.dumps(rows))
    return 0


def pair_times(
    backend: parallelx.Backend, config: Any, model: nn.Module, opt: Any, batch: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """This model's step time against the same model without checkpointing, in the same processes."""
    plain = parallelx.get_backend(args.backend, activation_checkpointing=None).init()
    try:
        other, other_opt = build(plain, config, args.seed)
        timed_steps(plain, other, other_opt, batch, 1)  # its first step allocates AdamW's state
        ac, no_ac, ratios = [], [], []
        for r in range(args.rounds):
            blocks = {}
            # Which goes first alternates: a block right after the other's may inherit its cache state.
            for name in ("ac", "plain") if r % 2 == 0 else ("plain", "ac"):
                b, m, o = (backend, model, opt) if name == "ac" else (plain, other, other_opt)
                blocks[name] = statistics.median(timed_steps(b, m, o, batch, args.block_steps))
            ac.append(blocks["ac"])
            no_ac.append(blocks["plain"])
            ratios.append(blocks["ac"] / blocks["plain"])
    finally:
        plain.shutdown()  # the first backend made the process group: this one goes first
    ratios.sort()
    return {
        "paired_ac_step_s": statistics.median(ac),
        "paired_plain_step_s": statistics.median(no_ac),
        "time_ratio": statistics.median(ratios),
        "time_ratio_range": [ratios[0], ratios[-1]],
        "rounds": args.rounds,
    }


def run_case(backend: str, setting: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    out = work / f"{backend}-{setting}.json"
    target = [
        "-m",
        "benchmarks.activations",
        "--worker",
        "--backend",
        backend,
        "--setting",
        setting,
        *("--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd)),
        *("--block-size", str(args.block_size), "--dropout", str(args.dropout), "--batch", str(args.batch)),
        *("--steps", str(args.steps), "--rounds", str(args.rounds), "--block-steps", str(args.block_steps)),
        *("--seed", str(args.seed), "--out", str(out)),
        *(["--pair"] if setting != "none" else []),
    ]
    done = runner.launch(
        parallelx.describe(backend).launcher,
        target,
        args.nproc,
        timeout=args.launch_timeout,
        cwd=Path(__file__).resolve().parents[1],
        env={"OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0 or not out.is_file():
        print(f"{backend} {setting}: failed (exit {done.returncode}):\n{done.tail(15)}", file=sys.stderr)
        return []
    return json.loads(out.read_text())


def same_weights(a: Path, b: Path) -> dict[str, Any]:
    sa, sb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    diff = max(float((sa[k].double() - sb[k].double()).abs().max()) for k in sa)
    return {"identical": sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), "max_abs_diff": diff}


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | processes | saved activations, no AC / AC | AC / no AC | peak RSS growth, no AC / AC "
        "| step, no AC / AC | step time AC / no AC (range) | final weights AC vs no AC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        none, auto = r["none"], r["auto"]
        if not none or not auto:
            lines.append(f"| {r['backend']} | {r['nproc']} | failed | | | | | |")
            continue
        s0, s1 = max(x["saved_bytes"] for x in none), max(x["saved_bytes"] for x in auto)
        m0, m1 = max(x["rss_growth"] for x in none), max(x["rss_growth"] for x in auto)
        t = auto[0]  # rank 0's times: the ranks wait for each other every step
        w = r["weights"]
        lines.append(
            f"| {r['backend']} | {r['nproc']} | {s0 / MIB:.1f} / {s1 / MIB:.1f} MiB | {s1 / s0:.2f} | "
            f"{m0 / MIB:.0f} / {m1 / MIB:.0f} MiB | {1e3 * t['paired_plain_step_s']:.0f} / "
            f"{1e3 * t['paired_ac_step_s']:.0f} ms | {t['time_ratio']:.2f} ({t['time_ratio_range'][0]:.2f}-"
            f"{t['time_ratio_range'][1]:.2f}, {t['rounds']} rounds) | "
            f"{'identical' if w['identical'] else 'differ, max abs ' + format(w['max_abs_diff'], '.1e')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--backends", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=96, help="the width (the recipe's default: 96)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=32, help="sequences per process")
    p.add_argument("--steps", type=int, default=4, help="measured steps per setting")
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds for the step time")
    p.add_argument("--block-steps", type=int, default=3, help="steps per round per setting")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--launch-timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--tiny", action="store_true", help="2 layers of width 32, batch 4, 1 step: a smoke test")
    p.add_argument("--out", type=Path, default=None, help="the JSON results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)
    p.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    signal.signal(signal.SIGTERM, on_sigterm)  # a timeout from outside still ends the running launch
    if args.tiny:
        args.n_layer, args.n_head, args.n_embd, args.batch = 2, 2, 32, 4
        args.steps, args.rounds, args.block_steps = 1, 1, 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
            row: dict[str, Any] = {"backend": name, "nproc": args.nproc}
            row.update({setting: run_case(name, setting, args, work) for setting in SETTINGS})
            if row["none"] and row["auto"]:
                row["weights"] = same_weights(work / f"{name}-none.pt", work / f"{name}-auto.pt")
            results.append(row)
    print(table(results), end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0 if all(r["none"] and r["auto"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
