"""``torch.compile`` on ddp, fsdp and DeepSpeed's ZeRO-3, in one torchrun
launch (``tests/support/compile_worker.py``): each compiled as its backend
needs (ddp's wrapper, fsdp's units before ``fully_shard``, DeepSpeed's
engine), against the same run eager.

On the CPU the inductor generates C++ whose fused kernels round differently
from eager's: after 3 AdamW steps the compiled weights are within 1e-4 of
the eager ones (the issue's bar; measured in the report), not equal.  The
checkpoints have plain names (no ``_orig_mod.``) and load into the plain
model; an eager run resumes a compiled run's training state; a model the user
compiled before ``setup`` trains as the backend compiles it.

With dropout, the compiled run draws eager's masks (inductor's ``fallback_random``, the
default): it stays within the same bar of eager as without dropout, where inductor's own
draws (``--compile-random inductor``) leave it by percents.
"""

from __future__ import annotations

import json

import pytest
import torch
from launching import launch, require_launcher

# A scenario: inductor's cold cache makes it the longest launch of all (215 s from a fresh clone).
pytestmark = [pytest.mark.scenario, pytest.mark.launcher, pytest.mark.timeout(900)]

BACKENDS = ("ddp", "fsdp", "deepspeed-zero3")
COMPILED_VS_EAGER = 1e-4


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    require_launcher("torchrun")
    out = tmp_path_factory.mktemp("compile")
    res = launch("torchrun", ["tests/support/compile_worker.py", "--out", str(out)], timeout=840)
    assert res.returncode == 0, res.tail(80)
    return {"out": out, "report": json.loads((out / "report.json").read_text())}


def test_compiled_runs_agree_with_eager(compiled):
    for name in BACKENDS:
        rel = compiled["report"][name]["rel"]
        assert max(rel.values()) < COMPILED_VS_EAGER, (name, max(rel.items(), key=lambda kv: kv[1]))
        assert max(rel.values()) > 0, f"{name}: the compiled run is eager's to the bit: was it compiled at all?"


def test_compiled_backends_against_each_other(compiled):
    ddp = torch.load(compiled["out"] / "ddp-compiled-weights.pt", weights_only=True)
    for name in BACKENDS[1:]:
        other = torch.load(compiled["out"] / f"{name}-compiled-weights.pt", weights_only=True)
        worst = max(float((other[k] - ddp[k]).norm() / ddp[k].norm()) for k in ddp)
        assert worst < COMPILED_VS_EAGER, (name, worst)


def test_checkpoints_have_plain_names_and_load_into_the_plain_model(compiled):
    import sys

    sys.path.insert(0, "tests/support")
    from gpt import GPT, Config

    for name in BACKENDS:
        for mode in ("eager", "compiled"):
            state = torch.load(compiled["out"] / f"{name}-{mode}.pt", weights_only=True)["model"]
            assert not any("_orig_mod" in k for k in state), (name, mode)
            GPT(Config(bias=False)).load_state_dict(state)  # strict: every name and shape


def test_eager_resumes_a_compiled_run(compiled):
    for name in BACKENDS:
        assert compiled["report"][name]["resumed_equal"], name


def test_a_model_compiled_before_setup(compiled):
    ddp = compiled["report"]["ddp"]
    assert ddp["user_compiled_rel"] < COMPILED_VS_EAGER
    assert not any("_orig_mod" in k for k in ddp["user_compiled_keys"])


def test_compiled_dropout_draws_eagers_masks(compiled):
    rel = compiled["report"]["ddp"]["dropout_rel"]
    assert rel["eager_random"] < COMPILED_VS_EAGER, rel
    # inductor's own masks: the comparison can fail, and the option reaches inductor
    assert rel["inductor_random"] > 100 * COMPILED_VS_EAGER, rel
