"""``python -m parallelx check``'s judgement, fed synthetic runs: what each
rank of each run recorded (the probe's records) and rank 0's tensors.  No
launch: the same analysis the command runs on real records."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from parallelx.check.analysis import MIN_TOLERANCE, Analysis, compare, noise_only, per_tensor, rel
from parallelx.check.command import _target, check_script
from parallelx.check.report import COULD_NOT_RUN, DIFFERS, SAME, Report, from_dict
from parallelx.check.runs import RunResult, RunSpec, last_error_line, plan
from parallelx.errors import ParallelxError

STEPS = 3
G = torch.Generator().manual_seed(0)
WEIGHTS = {"0.weight": torch.randn(8, 4, generator=G), "0.bias": torch.randn(8, generator=G)}
GRADS = {"0.weight": torch.randn(8, 4, generator=G), "0.bias": torch.randn(8, generator=G)}


def nudged(tensors: dict[str, torch.Tensor], by: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """``tensors`` with each element moved by ``by`` relative, random signs."""
    g = torch.Generator().manual_seed(seed)
    return {k: v * (1 + by * (torch.randint(0, 2, v.shape, generator=g) * 2 - 1)) for k, v in tensors.items()}


def record(rank: int, vranks: list[int]) -> dict[str, Any]:
    """What a rank of a correct run records (the reference: one record for every virtual rank)."""
    micro, losses, steps = [], [], []
    for s in range(1, STEPS + 1):
        for v in vranks:
            micro.append(
                {
                    "step": s,
                    "rank": v,
                    "input": f"x{s}.{v}",
                    "rng": {"torch": f"t{s}", "numpy": f"n{rank}"},
                    "draws": [],
                    "buffers": {},
                }
            )
            losses.append({"step": s, "rank": v, "loss": 2.0 / s + 0.01 * v})
        steps.append(
            {
                "step": s,
                "grad_norm": 3.0 / s,
                "grads": {"0.weight": f"g{s}"},
                "groups": [{"lr": 0.1, "momentum": 0.9}],
                "weights": {"0.weight": f"w{s}", "0.bias": f"b{s}"},
            }
        )
    return {
        "rank": rank,
        "backend": "ddp",
        "models": [
            {
                "initial": {"0.weight": "i0", "0.bias": "i1"},
                "buffers": [],
                "batchnorm": False,
                "batchnorm_per_rank": False,
            }
        ],
        "samplers": [{"size": 100}],
        "micro": micro,
        "losses": losses,
        "steps": steps,
        "steps_done": STEPS,
        "stopped": f"stopped after {STEPS} optimizer steps",
        "options": {"accumulate": 1, "clip_grad_norm": None, "precision": "32", "grad_compression": "none"},
        "reference": {"limits": []},
    }


def run(
    label: str,
    *,
    real: bool = True,
    perturb: float = 0.0,
    weights: dict[str, torch.Tensor] | None = None,
    grads: dict[str, torch.Tensor] | None = None,
    edit: Callable[[int, dict[str, Any]], None] | None = None,
    nproc: int = 2,
) -> RunResult:
    spec = RunSpec(label, "ddp" if real else "single", (), nproc if real else 1, ranks=0 if real else nproc)
    ranks = {}
    for r in range(nproc) if real else [0]:
        rec = record(r, [r] if real else list(range(nproc)))
        if edit is not None:
            edit(r, rec)
        ranks[r] = rec
    return RunResult(
        spec,
        seconds=1.0,
        ranks=ranks,
        weights=dict(WEIGHTS) if weights is None else weights,
        grads=dict(GRADS) if grads is None else grads,
    )


def check(*runs: RunResult, reference: RunResult | None = None, floor: RunResult | None = None) -> Report:
    reference = reference if reference is not None else run("reference", real=False)
    floor = (
        floor
        if floor is not None
        else run("floor", real=False, weights=nudged(WEIGHTS, 1e-7), grads=nudged(GRADS, 1e-7))
    )
    return Analysis(["train.py"], reference, floor, list(runs), nproc=2, steps=STEPS).report()


def causes(report: Report) -> list[str]:
    return [f.cause for f in report.differences()]


# ---------------------------------------------------------------- agreement
def test_identical_runs_agree_at_level_2():
    report = check(run("ddp"), run("horovod"), run("fsdp"))
    assert report.exit_code == SAME and report.same, report.render()
    assert report.level == 2 and report.level_reason is None
    assert [r.status for r in report.rows] == ["same"] * 3
    assert all(r.ranks_agree for r in report.rows)
    assert report.floor_weights == pytest.approx(1e-7, rel=0.5)
    assert "exit 0" in report.verdict


def test_a_difference_within_the_floor_passes_and_is_named():
    zero3 = run("deepspeed-zero3", weights=nudged(WEIGHTS, 5e-7, seed=3))  # 5x the floor: another order of additions
    report = check(run("ddp"), zero3)
    assert report.exit_code == SAME, report.render()
    row = report.row("deepspeed-zero3")
    assert 0 < row.weights_vs_baseline.worst < row.weights_vs_baseline.tolerance
    assert any("deepspeed-zero3: within the floor" in n for n in report.notes)


def test_a_difference_beyond_the_floor_fails_with_where_and_from_when():
    def lr_bug(rank: int, rec: dict[str, Any]) -> None:
        for e in rec["losses"]:
            if e["step"] >= 2:
                e["loss"] *= 1.01

    report = check(run("ddp"), run("horovod", weights=nudged(WEIGHTS, 1e-3, seed=3), edit=lr_bug))
    assert report.exit_code == DIFFERS
    row = report.row("horovod")
    assert row.status == "differs" and row.first_step_out == 2 and row.first_step_what == "loss"
    assert set(row.weights_vs_baseline.out) == set(WEIGHTS)
    # Level 2: horovod leaves one process too; ddp does not, so the cause is horovod's.
    assert causes(report) == ["backends-differ"]
    assert "horovod differs from ddp from step 2 (loss)" in report.differences()[0].what


def test_everyone_off_the_reference_alone_is_a_level_2_difference():
    shifted = nudged(WEIGHTS, 1e-3, seed=5)
    report = check(run("ddp", weights=shifted), run("fsdp", weights=shifted))
    assert causes(report) == ["differs-from-one-process"], report.render()
    assert "while the backends agree with each other" in report.differences()[0].what


def test_the_least_tolerance_follows_the_precision_and_rtol():
    def bf16(rank: int, rec: dict[str, Any]) -> None:
        rec["options"]["precision"] = "bf16-mixed"

    assert check(run("ddp", edit=bf16)).min_tolerance == MIN_TOLERANCE["bf16-mixed"]
    a = Analysis(["t.py"], run("reference", real=False), None, [run("ddp")], nproc=2, steps=STEPS, rtol=1e-3)
    assert a.report().min_tolerance == 1e-3


# ---------------------------------------------------------------- the diagnoses
def test_rank_dependent_learning_rate():
    def lr(rank: int, rec: dict[str, Any]) -> None:
        for e in rec["steps"]:
            e["groups"][0]["lr"] = 0.1 * (1 + 0.5 * rank)
            e["weights"]["0.bias"] += f"@{rank}"

    report = check(run("ddp", edit=lr))
    assert causes(report) == ["rank-dependent-hyperparameters"]
    f = report.differences()[0]
    assert "group 0's lr is 0.1 on rank 0 and 0.15 on rank 1" in f.what
    assert report.row("ddp").ranks_agree is False and report.row("ddp").ranks_differ_at == 1


def test_a_step_on_some_ranks_only():
    def main_only(rank: int, rec: dict[str, Any]) -> None:
        if rank == 1:
            rec["steps"], rec["steps_done"] = [], 0
            rec["stopped"] = "stopped after 0 steps: another rank had finished"

    run_ = run("ddp", edit=main_only)
    run_.launch_error = "exited with status 1; RuntimeError: Connection closed by peer"
    report = check(run_)
    assert causes(report) == ["step-on-some-ranks"]
    assert "rank 1 took 0, the others 3" in report.differences()[0].what
    assert report.exit_code == DIFFERS  # the launch failed, but because of the difference
    assert any("a consequence of the difference above" in n for n in report.notes)


def test_gradients_that_differ_between_ranks():
    def grads(rank: int, rec: dict[str, Any]) -> None:
        rec["steps"][0]["grads"]["0.weight"] += f"@{rank}"
        rec["steps"][0]["weights"]["0.weight"] += f"@{rank}"

    assert causes(check(run("ddp", edit=grads))) == ["rank-dependent-gradients"]


def test_ranks_reading_the_same_samples():
    def same(rank: int, rec: dict[str, Any]) -> None:
        for m in rec["micro"]:
            m["input"] = f"x{m['step']}"

    report = check(run("ddp", edit=same))
    assert "unsharded-loader" in causes(report)
    assert "backend.make_sampler(dataset)" in report.differences()[0].fix


def test_initial_weights_that_differ_between_runs():
    def unseeded(rank: int, rec: dict[str, Any]) -> None:
        rec["models"][0]["initial"] = {"0.weight": "other", "0.bias": "i1"}

    report = check(run("ddp"), run("horovod", edit=unseeded))
    assert causes(report) == ["initial-weights"]
    assert "the initial weights differ between runs (0.weight" in report.differences()[0].what
    assert "seed_everything" in report.differences()[0].fix


def test_data_that_differs_between_runs():
    def jitter(rank: int, rec: dict[str, Any]) -> None:
        for m in rec["micro"]:
            m["input"] += "~"

    assert causes(check(run("ddp"), run("fsdp", edit=jitter))) == ["data-randomness"]


def test_dropout_that_the_runs_do_not_share():
    def dropout(rank: int, rec: dict[str, Any]) -> None:
        for m in rec["micro"]:
            m["draws"] = ["torch"]

    def unseeded(rank: int, rec: dict[str, Any]) -> None:
        dropout(rank, rec)
        for m in rec["micro"]:
            m["rng"]["torch"] += "?"
        rec["losses"][0]["loss"] += 0.3

    report = check(run("ddp", edit=dropout), run("horovod", edit=unseeded))
    assert causes(report) == ["forward-randomness"]
    assert "the generators' state at the first forward differs" in report.differences()[0].what


def test_a_generator_the_forward_does_not_use_may_differ():
    """NumPy unseeded (a different state on every rank, in every run) does not matter when only torch draws."""

    def numpy(rank: int, rec: dict[str, Any]) -> None:
        for m in rec["micro"]:
            m["draws"] = ["torch"]
            m["rng"]["numpy"] = f"random{rank}"

    report = check(run("ddp", edit=numpy), run("horovod", edit=numpy))
    assert report.exit_code == SAME and report.level == 2, report.render()


def test_a_backend_option_that_changes_the_math():
    def clipped(rank: int, rec: dict[str, Any]) -> None:
        rec["options"]["clip_grad_norm"] = 0.25
        for e in rec["losses"]:
            if e["step"] > 1:
                e["loss"] += 0.1

    ds = run("deepspeed-zero0", weights=nudged(WEIGHTS, 1e-2), edit=clipped)
    ds.warnings = ["deepspeed: the config sets gradient_clipping=0.25; the update now differs from what one process"]
    report = check(run("ddp"), ds)
    assert causes(report) == ["backend-option"]
    what = report.differences()[0].what
    assert "clip_grad_norm=0.25 (on the one-process reference: None)" in what and "gradient_clipping=0.25" in what
    assert report.row("deepspeed-zero0").grads_vs_baseline.worst == 0  # the gradients agree: the update does not


def test_batchnorm_statistics_that_differ_between_ranks():
    def calibrated(rank: int, rec: dict[str, Any]) -> None:
        rec["models"][0].update(batchnorm=True, batchnorm_per_rank=True, buffers=["1.running_mean"])
        first = rec["micro"][0]
        first["buffers"] = {"1.running_mean": f"rank{rank}"}

    def reference_calibrated(rank: int, rec: dict[str, Any]) -> None:
        for v, m in enumerate(rec["micro"][:2]):
            m["buffers"] = {"1.running_mean": f"rank{v}"}

    moved = nudged(WEIGHTS, 1e-2)  # what the reference's statistics make of the weights
    ref = run("reference", real=False, weights=moved, edit=reference_calibrated)
    floor = run("floor", real=False, weights=nudged(moved, 1e-7), edit=reference_calibrated)
    report = check(run("ddp", edit=calibrated), reference=ref, floor=floor)
    assert causes(report) == ["batchnorm-statistics"]
    f = report.differences()[0]
    assert "different BatchNorm statistics (1.running_mean" in f.what and "sync_batchnorm" in f.fix


def test_per_rank_batchnorm_alone_is_inherent_not_a_failure():
    def bn(rank: int, rec: dict[str, Any]) -> None:
        rec["models"][0].update(batchnorm=True, batchnorm_per_rank=True)

    report = check(run("ddp", edit=bn))
    assert report.exit_code == SAME
    note = next(f for f in report.findings if f.cause == "batchnorm-per-rank")
    assert not note.fails and "inherent" in note.what


# ---------------------------------------------------------------- level 2 and its limits
def test_a_reference_that_could_not_rebuild_the_data_leaves_level_1():
    def other(rank: int, rec: dict[str, Any]) -> None:
        rec["micro"][1]["input"] = "worker-augmented"

    report = check(run("ddp"), run("fsdp"), reference=run("reference", real=False, edit=other))
    assert report.level == 1 and report.exit_code == SAME
    assert "could not rebuild rank 1's inputs at step 1" in report.level_reason


def test_the_reference_s_own_limits_and_per_rank_random_streams():
    def no_sampler(rank: int, rec: dict[str, Any]) -> None:
        rec["reference"]["limits"] = ["the script reads no data through backend.make_sampler"]

    report = check(run("ddp"), reference=run("reference", real=False, edit=no_sampler))
    assert report.level == 1 and "make_sampler" in report.level_reason

    def seeded_by_rank(rank: int, rec: dict[str, Any]) -> None:
        for m in rec["micro"]:
            m["draws"], m["rng"]["torch"] = ["torch"], f"seed{rank}"

    report = check(run("ddp", edit=seeded_by_rank), run("fsdp", edit=seeded_by_rank))
    assert report.level == 1 and "a seed that depends on the rank" in report.level_reason
    assert report.exit_code == SAME


def test_a_schedule_counted_in_the_script_s_own_iterations_leaves_level_1():
    def per_iteration(rank: int, rec: dict[str, Any]) -> None:
        rec["steps"][1]["groups"][0]["lr"] = 0.05

    report = check(run("ddp"), reference=run("reference", real=False, edit=per_iteration))
    assert report.level == 1 and "its own count of iterations" in report.level_reason


def test_a_floor_run_that_did_not_repeat_the_reference_is_not_used():
    def unseeded(rank: int, rec: dict[str, Any]) -> None:
        rec["micro"][0]["input"] = "other"

    floor = run("floor", real=False, weights=nudged(WEIGHTS, 0.5), edit=unseeded)
    report = check(run("ddp"), floor=floor)
    assert report.floor_weights is None and "read different inputs" in report.floor_method
    assert report.row("ddp").weights_vs_reference.tolerance == MIN_TOLERANCE["32"]


# ---------------------------------------------------------------- runs that failed
def test_a_run_without_records_could_not_run():
    broken = RunResult(RunSpec("horovod", "horovod"), seconds=2.0, returncode=1, error="exited with status 1; boom")
    report = check(run("ddp"), broken)
    assert report.exit_code == COULD_NOT_RUN
    assert report.row("horovod").status == "failed"
    assert "exit 2" in report.verdict and "horovod" in report.verdict and "boom" in report.verdict
    assert "horovod failed: exited with status 1; boom" in report.render()


def test_nothing_usable_at_all_could_not_run():
    def crashed(label: str, ranks: int = 0) -> RunResult:
        spec = RunSpec(label, "single" if ranks else "ddp", (), 1 if ranks else 2, ranks=ranks)
        return RunResult(spec, returncode=1, error="exited with status 1; ValueError: no data here")

    report = check(crashed("ddp"), reference=crashed("reference", 2), floor=crashed("floor", 2))
    assert report.exit_code == COULD_NOT_RUN and "ValueError: no data here" in report.verdict


def test_a_failed_launch_with_records_and_nothing_to_explain_it_could_not_run():
    late = run("fsdp")
    late.launch_error = "timed out after 600s and was killed"
    assert check(run("ddp"), late).exit_code == COULD_NOT_RUN


def test_a_failed_reference_leaves_level_1_with_its_reason():
    ref = RunResult(RunSpec("reference", "single", (), 1, ranks=2), error="exited with status 1; KeyError: 'x'")
    report = check(run("ddp"), run("fsdp"), reference=ref)
    assert report.level == 1 and "the one-process reference failed" in report.level_reason
    assert report.floor_weights is None and report.exit_code == SAME


def test_the_line_that_says_why_a_run_failed():
    tail = "[rank1]: Traceback (most recent call last):\n[rank1]:   File x\n[rank1]: ValueError: bad shape\nE1203 exit"
    assert last_error_line(tail) == "ValueError: bad shape"
    torchrun = tail + "\n[rank0]: RuntimeError: Connection closed by peer\nChildFailedError:\n====="
    assert last_error_line(torchrun) == "ValueError: bad shape"  # the first (a peer's is its echo), not torchrun's
    assert last_error_line("error: the script needs --data-dir\n") == "error: the script needs --data-dir"
    assert last_error_line("") == "no output"


# ---------------------------------------------------------------- numbers
def test_relative_differences():
    a = torch.ones(4)
    assert rel(a, a.clone()) == 0
    assert rel(a, a * (1 + 1e-3)) == pytest.approx(1e-3 / (1 + 1e-3), rel=1e-4)  # float32 inputs
    assert rel(torch.tensor([3]), torch.tensor([4])) == 1.0  # counters: equal or not
    assert rel(a, torch.ones(5)) == math.inf
    assert per_tensor({"a": a}, {"b": a}) == {"a": math.inf, "b": math.inf}


def test_compare_judges_each_tensor_against_its_own_floor():
    a = {"x": torch.ones(10), "y": torch.ones(10), "n": torch.tensor([3])}
    b = {"x": torch.ones(10) * (1 + 1e-4), "y": torch.ones(10) * (1 + 1e-4), "n": torch.tensor([4])}
    d = compare(a, b, {"x": 1e-4, "y": 1e-6}, 1e-6)
    assert d.out == ["n", "y"] and d.tensor in ("x", "y")  # the counter is out, never "the largest"
    assert compare(None, b, None, 1e-6) is None


def test_noise_only_gradients_are_found():
    signal = torch.linspace(1, 2, 96)
    ref, floor = signal.clone(), signal.clone()
    ref[32:64] = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 1e-10  # GPT-2's key bias
    floor[32:64] = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 1e-10
    found = noise_only({"c_attn.bias": ref, "w": signal}, {"c_attn.bias": floor, "w": signal * (1 + 1e-7)})
    assert set(found) == {"c_attn.bias"} and 20 <= found["c_attn.bias"][0] <= 32 and found["c_attn.bias"][1] == 96


# ---------------------------------------------------------------- the report
def test_the_report_reads_back_and_renders_the_same():
    report = check(run("ddp"), run("horovod", weights=nudged(WEIGHTS, 1e-3)))
    data = json.loads(json.dumps(report.to_dict(), default=str))
    again = from_dict(copy.deepcopy(data))
    assert again.render() == report.render()
    text = report.render()
    for part in ("parallelx check: train.py", "noise floor:", "tolerance:", "ranks agree", "differences:", "fix:"):
        assert part in text, part
    assert text.rstrip().splitlines()[-1].startswith("verdict: exit 1")


# ---------------------------------------------------------------- bad input
def test_bad_targets_and_options_say_what_to_do(tmp_path):
    with pytest.raises(ParallelxError, match="does not exist"):
        _target("missing.py", (), tmp_path)
    (tmp_path / "t.py").write_text("")
    assert _target("t.py", ("--lr", "1"), tmp_path) == ["t.py", "--lr", "1"]
    assert _target("-m pkg.train", ("--x",), tmp_path) == ["-m", "pkg.train", "--x"]
    with pytest.raises(ParallelxError, match="leave --backend out"):
        _target("t.py", ("--backend", "ddp"), tmp_path)
    with pytest.raises(ParallelxError, match="unknown backend 'nccl'"):
        plan(["nccl"], (0,), 2)
    with pytest.raises(ParallelxError, match="runs one process"):
        plan(["single"], (0,), 2)
    with pytest.raises(ParallelxError, match="nproc must be >= 2"):
        check_script(str(tmp_path / "t.py"), nproc=1)
    with pytest.raises(ParallelxError, match="steps must be >= 1"):
        check_script(str(tmp_path / "t.py"), steps=0)


def test_a_backend_with_stages_runs_once_per_stage():
    specs = plan(["ddp", "deepspeed"], (0, 3), 2)
    assert [s.label for s in specs] == ["ddp", "deepspeed-zero0", "deepspeed-zero3"]
    assert specs[2].extra == ("--zero-stage", "3")


def test_the_command_line_refuses_bad_options_with_exit_status_2(capsys):
    from parallelx.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["check", "--zero-stages", "zero", "--", "train.py"])
    assert exc.value.code == 2
    assert "--zero-stages must be a comma-separated list of integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["check"])
    assert exc.value.code == 2
    assert "nothing to check" in capsys.readouterr().err


# ---------------------------------------------------------------- one backend and the reference
def test_with_one_backend_a_script_that_does_not_repeat_itself_is_the_script_s_fault():
    """Unseeded augmentation: the reference, its repeat and the run all read other inputs."""

    def jitter(tag: str) -> Callable[[int, dict[str, Any]], None]:
        def edit(rank: int, rec: dict[str, Any]) -> None:
            for m in rec["micro"]:
                m["input"] += tag

        return edit

    floor = run("floor", real=False, weights=nudged(WEIGHTS, 1e-7), edit=jitter("~"))
    report = check(run("ddp", edit=jitter("!")), floor=floor)
    assert causes(report) == ["data-randomness"], report.render()
    assert "read different inputs" in report.floor_method


def test_with_one_backend_what_only_the_replay_misses_is_a_limit_not_a_failure():
    """Augmentation drawn in DataLoader workers: the reference repeats itself exactly, yet
    cannot draw what the ranks' workers drew."""

    def workers(rank: int, rec: dict[str, Any]) -> None:
        for m in rec["micro"]:
            m["input"] += "@worker"

    report = check(run("ddp", edit=workers))
    assert report.exit_code == SAME and report.level == 1, report.render()
    assert "could not rebuild rank 0's inputs" in report.level_reason


def test_a_script_whose_steps_the_check_never_sees_could_not_run():
    def no_steps(rank: int, rec: dict[str, Any]) -> None:
        rec["steps"], rec["steps_done"] = [], 0
        rec["stopped"] = "the script ended after 0 optimizer steps"

    report = check(run("ddp", edit=no_steps), reference=run("reference", real=False, edit=no_steps))
    assert report.exit_code == COULD_NOT_RUN and "backend.wrap_optimizer" in report.verdict


# ---------------------------------------------------------------- gradients read too early
def early_read(rank: int, rec: dict[str, Any]) -> None:
    """Each rank's own gradients read before the backend averaged them (their norm ~0.7 off)."""
    for e in rec["steps"]:
        e["grad_norm"] *= 1.7


def test_gradients_read_before_their_averaging_never_accuse_a_script_whose_weights_are_exact():
    zero0 = run("deepspeed-zero0", grads=nudged(GRADS, 0.5, seed=4), edit=early_read)
    report = check(run("ddp"), zero0)
    assert report.exit_code == SAME, report.render()
    assert report.row("deepspeed-zero0").status == "same" and report.row("deepspeed-zero0").first_step_out is None
    misread = [n for n in report.notes if n.startswith("deepspeed-zero0:") and "before they were final" in n]
    assert misread and "not of the script" in misread[0], report.notes


def test_gradients_that_differ_with_weights_that_differ_at_one_step_still_fail():
    def step_2_off(rank: int, rec: dict[str, Any]) -> None:
        early_read(rank, rec)
        rec["steps"][1]["weights"]["0.weight"] = "other"

    zero0 = run("deepspeed-zero0", grads=nudged(GRADS, 0.5, seed=4), edit=step_2_off)
    report = check(run("ddp"), zero0)
    assert report.exit_code == DIFFERS, report.render()
    assert report.row("deepspeed-zero0").first_step_out == 1
    assert not any("before they were final" in n for n in report.notes)


def test_a_run_that_raised_before_its_first_step_could_not_run_with_its_error():
    def raised(rank: int, rec: dict[str, Any]) -> None:
        rec["steps"], rec["steps_done"] = [], 0
        rec["stopped"] = "the script ended after 0 optimizer steps"

    crashed = run("deepspeed-zero0", grads=None, edit=raised)
    crashed.grads = None
    crashed.launch_error = "exited with status 1; RuntimeError: Direct calls to tensor.backward() are not supported"
    report = check(crashed)
    assert report.exit_code == COULD_NOT_RUN, report.render()
    assert "RuntimeError: Direct calls" in report.verdict and "wrap_optimizer" not in report.verdict
    assert causes(report) == []
