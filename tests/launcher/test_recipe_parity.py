"""The recipes with every training-loop option under each launcher: the final
weights (``last.pth``) agree across ddp, horovod, deepspeed ZeRO 0-3 and fsdp.

CIFAR-10: a real learning rate and 2 loader workers per process, at world size 2;
ddp, horovod, ZeRO 0, 2 and 3, fsdp (ZeRO-1 runs the GPT recipe below).

The warm-up (4 of the 6 optimizer steps, more than the 3 of an epoch) keeps
the learning rate low while the clip binds at some steps (norms 0.4 to 1.2
against 0.5): where ZeRO's own clipping arithmetic once set ZeRO 1-3 apart,
by a few units in the last place per clipped step (3e-8 here, 1e-5 to 2e-2
on longer runs, where LeNet's kinks grow it).  So the backends that reduce
the gradients once per accumulation window, as ddp does, must give ddp's
weights to the bit: with 2 ranks their averaged gradients are ddp's bits.

The data order, the augmentation draws (random flips in the loader workers,
seeded per rank) and the dropout-free LeNet's update are the same on every
backend, whatever a backend's set-up draws from the random generators; the
only differences left are the order of float additions (1e-6 relative).

Each launch also checks the recipe's outputs and that its reported metrics
are exactly one process's evaluation of ``best.pth``.

GPT (``recipes/gpt.py``, a tiny one: 2 blocks, 32 wide, dropout): AdamW with a
decay and a no-decay group, the tied embedding, warm-up then cosine,
``--accumulate 2 --clip-grad-norm 1.0 --precision bf16-mixed``, a checkpoint
every 2 optimizer steps, the sample at the end; under every launcher (ddp,
horovod, ZeRO-1 and 3, fsdp) and under ``single``.  Each launch checks the outputs, tokens/s in the
progress bar, the sample printed once, and that the reported validation loss is
one process's evaluation of ``last.pth``; the multi-process backends' weights
are compared with ddp's where the gradients are reduced once per accumulation
window (horovod, ZeRO-1, fsdp): ddp's bits.  ZeRO-3 reduces each
micro-batch, so a window's gradients add in another order, and AdamW makes
steps of that rounding in the attention key bias (whose gradient is exactly
zero): its weights are not ddp's bits and no tolerance here would be a
measured one.  Its math is proven where it can be measured, at the first
step's gradients against ddp's with the noise floor beside it
(tests/launcher/test_transformers.py); here it must run the recipe through.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launching import backend_cases, in_make_test, launch, require_launcher
from recipe_outputs import check_cifar_metrics, check_gpt_metrics, check_gpt_outputs, check_outputs

# ZeRO-1 reduces once per window as ddp does, and the GPT recipe's launch below checks it to ddp's bits
# with clipping, bf16 and accumulation: here the stages whose order differs (2, 3) and ZeRO-0.
RUNS = backend_cases("ddp", "horovod", "deepspeed-zero0", "deepspeed-zero2", "deepspeed-zero3", "fsdp")
OPTIONS = [
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--lr",
    "0.05",
    "--accumulate",
    "3",
    "--clip-grad-norm",
    "0.5",
    "--precision",
    "bf16-mixed",
    "--lr-schedule",
    "cosine",
    "--warmup-epochs",
    "1.5",
    "--num-workers",
    "1",
]
REL_TOL = 1e-6
N_TEST = 31  # odd: the 2 ranks' shards are padded, and the metrics must leave the padding out
#: Gradients reduced once per window, as ddp's (ZeRO 2 and 3 reduce every micro-batch).
REDUCES_ONCE = {"horovod", "deepspeed-zero0", "deepspeed-zero1", "fsdp"}

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(240)]
#: Each run's last.pth, kept in memory (a passing test's folder is removed as it ends): later runs compare with it.
_DONE: dict[str, dict[str, torch.Tensor]] = {}


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    from recipes.make_data import make_cifar10

    out = tmp_path_factory.mktemp("cifar")
    make_cifar10(out, n_train=230, n_test=N_TEST, seed=0)  # 230 = 7 full micro-batches of 2 x 16 and a short one
    return out


@pytest.mark.parametrize("run", in_make_test(RUNS))
def test_recipe_weights_equal_across_backends(run, cifar_dir, tmp_path):
    launcher, backend, extra = RUNS[run]
    require_launcher(launcher)
    target = ["recipes/cifar10.py"] if launcher == "deepspeed" else ["-m", "recipes.cifar10"]
    out = tmp_path / "out"
    res = launch(
        launcher,
        [*target, "--backend", backend, *extra, "--data-dir", str(cifar_dir), "--out-dir", str(out), *OPTIONS],
        timeout=200,
    )
    assert res.returncode == 0, res.tail()
    assert "accumulate=3 clip_grad_norm=0.5 precision=bf16-mixed" in res.output
    # The recipe's outputs and exact metrics, as tests/launcher/test_recipes.py checks them in one process.
    metrics = check_outputs(res, out, backend, 2, epochs=2)
    check_cifar_metrics(metrics, out, cifar_dir, N_TEST, epochs=2, precision="bf16-mixed")
    a = _DONE[run] = torch.load(out / "last.pth", weights_only=True)
    first = next(iter(_DONE))
    if first == run:
        return
    b = _DONE[first]
    assert a.keys() == b.keys()
    err = max(float((a[k].float() - b[k].float()).norm() / max(b[k].float().norm(), 1e-12)) for k in b)
    assert err < REL_TOL, f"{run} vs {first}: {err:.3g}"
    if run in REDUCES_ONCE and first == "ddp":
        assert all(torch.equal(a[k], b[k]) for k in b), f"{run} rounds differently from ddp: {err:.3g}"


# ------------------------------------------------------------------ GPT
GPT_EPOCHS, GPT_SAMPLE = 2, 16
GPT_OPTIONS = [
    *["--generated-chars", "6000", "--block-size", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32"],
    *["--batch-size", "8", "--epochs", str(GPT_EPOCHS), "--max-steps", "4", "--lr", "4e-3", "--warmup-steps", "2"],
    *["--accumulate", "2", "--clip-grad-norm", "1.0", "--precision", "bf16-mixed", "--checkpoint-every", "2"],
    *["--sample-tokens", str(GPT_SAMPLE)],
]
# ZeRO-0 and 2 run the CIFAR-10 cases above and the GPT grid of the core launch; here the ZeRO stages whose
# state (1: several groups) and forward (3: a collective) a GPT meets differently.
GPT_RUNS = {
    **backend_cases("ddp", "horovod", "deepspeed-zero1", "deepspeed-zero3", "fsdp"),
    "single": ("python", "single", []),
}
_GPT_DONE: dict[str, dict[str, torch.Tensor]] = {}


@pytest.mark.parametrize("run", in_make_test(GPT_RUNS))
def test_gpt_recipe_under_every_backend(run, tmp_path):
    launcher, backend, extra = GPT_RUNS[run]
    require_launcher(launcher)
    target = ["recipes/gpt.py"] if launcher == "deepspeed" else ["-m", "recipes.gpt"]
    out = tmp_path / "out"
    res = launch(launcher, [*target, "--backend", backend, *extra, "--out-dir", str(out), *GPT_OPTIONS], timeout=200)
    assert res.returncode == 0, res.tail()
    assert "accumulate=2 clip_grad_norm=1.0 precision=bf16-mixed" in res.output
    world = 1 if backend == "single" else 2
    metrics = check_gpt_outputs(res, out, backend, world, GPT_EPOCHS, GPT_SAMPLE)
    check_gpt_metrics(metrics, out, precision="bf16-mixed")
    if world == 1 or run not in {"ddp", *REDUCES_ONCE}:
        return
    a = _GPT_DONE[run] = torch.load(out / "last.pth", weights_only=True)
    first = next(iter(_GPT_DONE))
    if first == run:
        return
    b = _GPT_DONE[first]
    assert a.keys() == b.keys()
    errs = {k: float((a[k].float() - b[k].float()).norm() / max(b[k].float().norm(), 1e-12)) for k in b}
    worst = max(errs, key=errs.__getitem__)
    assert errs[worst] < REL_TOL, f"{run} vs {first}: {errs[worst]:.3g} in {worst}"
    if run in REDUCES_ONCE and first == "ddp":
        assert all(torch.equal(a[k], b[k]) for k in b), f"{run} rounds differently from ddp: {errs[worst]:.3g}"
