"""DeepSpeed's CIFAR-10 tutorial in miniature (``tests/support/ds_tutorial_original.py``: a config dict
with an ``Adam`` section, ``WarmupLR``, ``gradient_clipping``, fp16's keys, ZeRO from ``--stage``, an
optional MoE layer) under plain DeepSpeed, against its parallelx port
(``tests/support/ds_tutorial_port.py``) under every backend: the same final weights within float
summation order.  With MoE (ZeRO 0-2; DeepSpeed has none under ZeRO-3) the port's ``backend.save``
holds every expert, rank 1's included, and a run resumed from its halfway checkpoint (the positional
and the named optimizer state) ends bitwise where the uninterrupted run ended; the other backends
refuse DeepSpeed's MoE layer at set-up with a ParallelxError.  Under DeepSpeed the stages run in one
launch per group (``tests/support/zero_stages.py``, :data:`STAGE_GROUPS`), the original's and the port's
each.  The folder the original's ``engine.save_checkpoint`` wrote loads as pretrained weights."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from launching import ROOT, in_make_test, launch, require_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]

ORIGINAL = "tests/support/ds_tutorial_original.py"
PORT = "tests/support/ds_tutorial_port.py"
TIMEOUT = 300
#: A launch of every stage (two of them fit the test's own timeout).
STAGES_TIMEOUT = 420
#: Float summation order (ZeRO's partitions, one process's batch of 16 against two of 8) over 8 AdamW
#: steps; measured 2.9e-7 (ZeRO-1 with MoE).
TOLERANCE = 1e-5
#: Plain DeepSpeed needs its JIT-built CPU communication op, which parallelx finds here by itself.
DS_ENV = {"TORCH_EXTENSIONS_DIR": str(ROOT / ".venv" / "torch_extensions")}

#: test id -> (launcher, port arguments, the original's ZeRO stage it is compared with)
PORTS: dict[str, tuple[str, list[str], int]] = {
    **{f"deepspeed-zero{z}": ("deepspeed", ["--backend", "deepspeed", "--stage", str(z)], z) for z in range(4)},
    **{
        f"deepspeed-zero{z}-moe": (
            "deepspeed",
            ["--backend", "deepspeed", "--stage", str(z), "--moe", "--resume-check"],
            z,
        )
        for z in range(3)
    },
    # The backends without ZeRO take --stage and ignore it (parallelx.from_args(args, zero_stage=...)).
    "ddp": ("torchrun", ["--backend", "ddp", "--stage", "2"], 0),
    "fsdp": ("torchrun", ["--backend", "fsdp", "--stage", "2"], 0),
    "horovod": ("horovodrun", ["--backend", "horovod"], 0),
    "single": ("python", ["--backend", "single"], 0),
}
#: test id -> (launcher, port arguments): DeepSpeed's MoE layer where it cannot run.
REFUSED: dict[str, tuple[str, list[str]]] = {
    "deepspeed-zero3-moe": ("deepspeed", ["--backend", "deepspeed", "--stage", "3", "--moe"]),
    "ddp-moe": ("torchrun", ["--backend", "ddp", "--moe"]),
    "fsdp-moe": ("torchrun", ["--backend", "fsdp", "--moe"]),
    "horovod-moe": ("horovodrun", ["--backend", "horovod", "--moe"]),
    "single-moe": ("python", ["--backend", "single", "--moe", "--ep-world-size", "1"]),
}

#: The DeepSpeed stages each launch runs (``tests/support/zero_stages.py``): one DeepSpeed start for all
#: of a group.  make test's case (ZeRO-1 with MoE) launches its stage alone; the scenarios the rest.
STAGE_GROUPS = {False: [(0, 1, 2, 3)], True: [(1,), (0, 2)]}
_runs: dict[tuple[str, bool, tuple[int, ...]], Path] = {}


def stages_run(script: str, moe: bool, extra: list[str], stage: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``script`` under the deepspeed launcher at every stage of ``stage``'s group of :data:`STAGE_GROUPS`,
    once per module: the folder holding ``zero<S>/`` for each."""
    group = next(g for g in STAGE_GROUPS[moe] if stage in g)
    if (script, moe, group) not in _runs:
        require_launcher("deepspeed")
        out = tmp_path_factory.mktemp(f"{Path(script).stem}{'-moe' if moe else ''}")
        stages = [str(z) for z in group]
        res = launch(
            "deepspeed",
            ["tests/support/zero_stages.py", script, "--stages", *stages, "--out", str(out), *extra],
            timeout=STAGES_TIMEOUT,
            env=DS_ENV,
        )
        assert res.returncode == 0, res.tail()
        _runs[script, moe, group] = out
    return _runs[script, moe, group]


def whole(folder: Path) -> dict[str, torch.Tensor]:
    """The original's weights from each rank's file: under MoE rank r's local expert j is expert r + j
    (one expert per rank at ep_size 2), the key every expert has in a whole state."""
    out: dict[str, torch.Tensor] = {}
    for r in range(2):
        for k, v in torch.load(folder / f"rank{r}.pt", weights_only=True)["model"].items():
            m = re.fullmatch(r"(.*deepspeed_experts\.)(\d+)(\..*)", k)
            if m:
                out[f"{m.group(1)}{r + int(m.group(2))}{m.group(3)}"] = v
            else:
                out.setdefault(k, v)
    return out


def original(stage: int, moe: bool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The tutorial's weights under plain DeepSpeed at ``stage``."""
    return whole(stages_run(ORIGINAL, moe, ["--moe"] if moe else [], stage, tmp_path_factory) / f"zero{stage}")


def ported(case: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the port's run of ``case``: DeepSpeed's stages share one launch, the others launch alone."""
    launcher, args, stage = PORTS[case]
    if launcher == "deepspeed":
        at = args.index("--stage")  # the launch runs every stage of the group
        return stages_run(PORT, "--moe" in args, args[:at] + args[at + 2 :], stage, tmp_path_factory) / f"zero{stage}"
    require_launcher(launcher)
    res = launch(launcher, [PORT, *args, "--out", str(tmp_path)], timeout=TIMEOUT)
    assert res.returncode == 0, res.tail()
    return tmp_path


def worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    return max(float((got[k].double() - ref[k].double()).abs().max()) for k in ref)


@pytest.mark.parametrize("case", in_make_test(PORTS, "deepspeed-zero1-moe"))
def test_the_port_trains_the_originals_weights(case, tmp_path, tmp_path_factory, record_property):
    launcher, args, stage = PORTS[case]
    moe = "--moe" in args
    ref = original(stage, moe, tmp_path_factory)
    out = ported(case, tmp_path, tmp_path_factory)
    final = torch.load(out / "final.pt", weights_only=True)
    diff = worst(final["model"], ref)
    record_property("max_abs_weight_diff", diff)
    norms = [norm for _, norm in final["figures"]]
    print(f"{case}: the port's weights differ from the original's by at most {diff:.3g}; gradient norms {norms}")
    assert diff < TOLERANCE, f"{case}: {diff:.3g}"
    if moe:
        experts = sorted(k for k in final["model"] if "deepspeed_experts" in k)
        assert [k.split("deepspeed_experts.")[1] for k in experts] == ["0.bias", "0.weight", "1.bias", "1.weight"]
        halfway = torch.load(out / "halfway.pt", weights_only=True)
        assert halfway["model"].keys() == final["model"].keys()
        for form in ("positional", "named"):
            resumed = torch.load(out / f"resumed-{form}.pt", weights_only=True)
            assert worst(resumed, final["model"]) == 0.0, f"{case}: resumed from the {form} state"


@pytest.mark.scenario  # the stages' launch of the original without MoE is a scenario
@pytest.mark.parametrize("stage", range(4))
def test_deepspeeds_checkpoint_folder_loads_as_pretrained_weights(stage, tmp_path_factory):
    """The folder the original's ``engine.save_checkpoint`` wrote (2 ranks' ZeRO partitions, put
    together by DeepSpeed's own code after a strict read of every file) is the original's weights, bit
    for bit, through ``parallelx.load_pretrained``: the folder (its ``latest``) and the step's folder."""
    from argparse import Namespace

    from ds_tutorial_original import Net

    import parallelx

    ref = original(stage, False, tmp_path_factory)
    folder = stages_run(ORIGINAL, False, [], stage, tmp_path_factory) / f"zero{stage}" / "checkpoints"
    tag = (folder / "latest").read_text().strip()
    for where in (folder, folder / tag):
        net = Net(Namespace(moe=False))
        parallelx.load_pretrained(net, where)
        got = net.state_dict()
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), where


@pytest.mark.scenario
@pytest.mark.parametrize("case", list(REFUSED))
def test_deepspeeds_moe_layer_is_refused_where_it_cannot_run(case, tmp_path):
    launcher, args = REFUSED[case]
    require_launcher(launcher)
    res = launch(launcher, [PORT, *args, "--out", str(tmp_path)], timeout=TIMEOUT)
    assert res.returncode != 0
    assert "ParallelxError" in res.output and "moe_layer_list.0" in res.output, res.tail()
    assert "all_to_all_single" not in res.output and "AssertionError" not in res.output, res.tail()
