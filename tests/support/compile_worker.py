"""Run under torchrun (2 processes): ``torch.compile`` on ddp, fsdp and
DeepSpeed's ZeRO-3, one after the other in one launch (the backends share
torchrun's process group; the inductor's compiled kernels are shared too).

For each backend: the GPT (``gpt.GPT``, nanoGPT's ``bias=False``) trained for
a few AdamW steps with accumulation, eager and compiled, from the same
start; the compiled run's portable checkpoint, which must load into the
plain model; a training-state checkpoint of the compiled run resumed by an
eager one; and on ddp a model the user compiled before ``setup``, and the GPT with dropout
compiled twice: drawing eager's masks (the default) and inductor's own (``eager_random=False``).  Rank 0
writes ``<out>/report.json`` and the weights, ``<out>/<backend>-<mode>.pt``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpt import GPT, Config, adamw_groups, tokens

import parallelx

CFG = Config(bias=False)
STEPS, ACCUMULATE, B = 3, 2, 4
BACKENDS = {"ddp": {}, "fsdp": {}, "deepspeed-zero3": {"zero_stage": 3}}


def run(
    backend: parallelx.Backend, model: torch.nn.Module, out: Path, tag: str, optimizer: Any = None
) -> dict[str, Any]:
    model, optimizer = backend.setup(model, optimizer or adamw_groups(model))
    started = time.perf_counter()
    first = None
    for i, (x, y) in enumerate(backend.batches([tokens(backend.rank, t, B, CFG) for t in range(STEPS * ACCUMULATE)])):
        _, loss = model(x, y)
        backend.backward(loss)
        backend.step(optimizer)
        if i == 0:
            first = time.perf_counter() - started
    total = time.perf_counter() - started
    weights = backend.model_state_dict(model)
    backend.save({"model": model}, out / f"{tag}.pt")
    parallelx.save_training_state(
        backend, out / f"run-{tag}", step=STEPS, model=model, optimizer=optimizer, counters={"step": STEPS}
    )
    return {"weights": weights, "first_s": first, "total_s": total, "model": model, "optimizer": optimizer}


def dropout_runs(out: Path) -> dict[str, float]:
    """The GPT with dropout 0.1 on ddp: the compiled runs' largest relative difference from eager's
    weights, with eager's random draws (the default) and with inductor's."""
    from parallelx.transforms.compiling import CompileOptions

    cfg = Config(bias=False, dropout=0.1)
    weights = {}
    for tag, compile_ in (
        ("eager", False),
        ("eager_random", True),
        ("inductor_random", CompileOptions(enabled=True, eager_random=False)),
    ):
        backend = parallelx.get_backend("ddp", accumulate=ACCUMULATE, clip_grad_norm=1.0, compile=compile_).init()
        torch.manual_seed(0)
        model = GPT(cfg)
        torch.manual_seed(7)  # the masks' generator, the same for every run
        weights[tag] = run(backend, model, out, f"dropout-{tag}")["weights"]
        backend.shutdown()  # the process group stays: the first backend of main() made it
    eager = weights.pop("eager")
    return {tag: max(float((w[k] - eager[k]).norm() / eager[k].norm()) for k in eager) for tag, w in weights.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    report: dict[str, Any] = {}
    owner = None
    for name, extra in BACKENDS.items():
        kind = name.split("-")[0]
        eager_backend = parallelx.get_backend(kind, accumulate=ACCUMULATE, clip_grad_norm=1.0, **extra).init()
        compiled_backend = parallelx.get_backend(
            kind, accumulate=ACCUMULATE, clip_grad_norm=1.0, compile=True, **extra
        ).init()
        owner = owner or eager_backend  # the first backend made the process group: it is shut down last
        torch.manual_seed(0)
        eager = run(eager_backend, GPT(CFG), args.out, f"{name}-eager")
        torch.manual_seed(0)
        compiled = run(compiled_backend, GPT(CFG), args.out, f"{name}-compiled")
        # The compiled run's checkpoint, resumed by an eager set-up.
        torch.manual_seed(1)
        fresh = GPT(CFG)
        model, optimizer = eager_backend.setup(fresh, adamw_groups(fresh))
        parallelx.load_training_state(
            eager_backend,
            parallelx.latest_checkpoint(args.out / f"run-{name}-compiled"),
            model=model,
            optimizer=optimizer,
        )
        resumed = eager_backend.model_state_dict(model)
        entry = {
            "first_step_s": {"eager": eager["first_s"], "compiled": compiled["first_s"]},
            "later_steps_s": {
                "eager": eager["total_s"] - eager["first_s"],
                "compiled": compiled["total_s"] - compiled["first_s"],
            },
            "rel": {
                k: float((compiled["weights"][k] - eager["weights"][k]).norm() / eager["weights"][k].norm())
                for k in eager["weights"]
            },
            "resumed_equal": all(torch.equal(resumed[k], compiled["weights"][k]) for k in resumed),
        }
        if kind == "ddp":  # a model the user compiled before setup
            torch.manual_seed(0)
            plain = GPT(CFG)
            groups = adamw_groups(plain)  # by the plain names, then the module compiled, as a script would
            user = run(eager_backend, torch.compile(plain), args.out, f"{name}-user-compiled", groups)
            entry["user_compiled_rel"] = max(
                float((user["weights"][k] - eager["weights"][k]).norm() / eager["weights"][k].norm())
                for k in eager["weights"]
            )
            entry["user_compiled_keys"] = sorted(user["weights"])[:3]
            entry["dropout_rel"] = dropout_runs(args.out)
        report[name] = entry
        if eager_backend.rank == 0:
            torch.save(eager["weights"], args.out / f"{name}-eager-weights.pt")
            torch.save(compiled["weights"], args.out / f"{name}-compiled-weights.pt")
        if compiled_backend is not owner:
            compiled_backend.shutdown()
        if eager_backend is not owner:
            eager_backend.shutdown()
    assert owner is not None
    if owner.rank == 0:
        (args.out / "report.json").write_text(json.dumps(report, indent=1))
    owner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(parallelx.exit_on_error(main)())
