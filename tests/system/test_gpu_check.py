"""The GPU check (``scripts/gpu_check.py``, which runs the ``scripts/gpu_check/``
package) in its CPU dry run, so that it cannot rot between the rare runs on a
GPU machine; the carried-wheels folder logic of ``scripts/gpu_wheels.py``
without downloading; ``gpu_check.sh``'s syntax.

    python -m pytest tests/system/test_gpu_check.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from launching import ROOT, run_with_grace

DRY_RUN_TIMEOUT_S = 420  # about 2 minutes on 2 idle cores; 4 to 6 on cores shared with other jobs
#: What only a GPU machine can check: the dry run must list each as skipped.
CUDA_ONLY = (
    "install / Horovod built with NCCL operations",
    "environment / GPU, CUDA, NCCL and cuDNN",
    "throughput / VGG16 224 px, 32/process, fp32",
    "throughput / VGG16 224 px, 32/process, bf16-mixed",
    "host-sync / synchronisations per step on ddp",
    "fsdp / fsdp against ddp, 16-mixed: memory per rank",
    "transformers / gpt on ddp --compile",
    "transformers / gpt on fsdp --compile",
    "transformers / gpt on fsdp --cpu-offload",
    "transformers / gpt on deepspeed --zero-stage 3 --compile",
    "transformers / gpt on deepspeed --zero-stage 3 --cpu-offload",
)
SECTIONS = ["install", "environment", "recipes", "throughput", "fsdp", "transformers", "host-sync"]


def load_script(name: str) -> ModuleType:
    """A module of ``scripts/`` (not an installed package), imported by path:
    ``gpu_wheels``, or ``gpu_check.check`` of the ``scripts/gpu_check/`` package."""
    if name in sys.modules:
        return sys.modules[name]
    if "." in name:
        load_script(name.split(".")[0])
        return importlib.import_module(name)
    path = ROOT / "scripts" / name
    if path.is_dir():
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
    else:
        spec = importlib.util.spec_from_file_location(name, path.with_suffix(".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------- the dry run


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    from benchmarks.launch import unavailable

    missing = "; ".join(f"{b}: {why}" for b in ("ddp", "horovod", "deepspeed") if (why := unavailable(b)))
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; run scripts/setup.sh")
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("gpu-check")
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "gpu_check.py"),
        "--dry-run",
        "--out",
        str(tmp / "out"),
        "--work",
        str(tmp / "work"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    # 20 s of grace: the check then kills the launch it is running and writes its report.
    rc, output = run_with_grace(cmd, timeout=DRY_RUN_TIMEOUT_S, grace=20, what="gpu_check.py --dry-run", env=env)
    return rc, output, tmp / "out"


@pytest.mark.launcher
@pytest.mark.matrix  # 4 to 5 minutes of launches: make test-matrix (CI's time: docs/testing.md)
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)
def test_dry_run_passes_and_writes_its_report(dry_run):
    rc, output, out = dry_run
    assert rc == 0, f"gpu_check.py --dry-run exited {rc}:\n{output[-6000:]}"
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["result"] == "passed" and summary["mode"] == "dry-run" and summary["nproc"] == 2
    report = (out / "report.md").read_text()
    assert "**Result: PASSED**" in report
    for name in SECTIONS:
        assert f"## {name}" in report
    # One progress line per step, with its time.
    assert "[gpu-check] recipes / cifar10 on ddp: passed in " in output


@pytest.mark.launcher
@pytest.mark.matrix  # 4 to 5 minutes of launches: make test-matrix (CI's time: docs/testing.md)
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)
def test_every_section_passed_or_was_skipped_with_a_reason(dry_run):
    _, output, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["sections"]) == SECTIONS
    for name, section in summary["sections"].items():
        assert section["status"] in ("passed", "skipped"), f"{name}: {section}"
        for item in section["items"]:
            assert item["status"] in ("passed", "skipped"), f"{name} / {item['name']}: {item['detail']}"
            if item["status"] == "skipped":
                assert len(item["detail"]) > 10, f"{name} / {item['name']} skipped without a reason"
    # What the dry run exists for ran: the recipes under every launcher (python: dogcat on single), the harnesses.
    items = {f"{n} / {i['name']}": i for n, s in summary["sections"].items() for i in s["items"]}
    for backend in ("ddp", "deepspeed", "horovod"):
        assert items[f"recipes / cifar10 on {backend}"]["status"] == "passed"
        figures = items[f"recipes / cifar10 on {backend}"]["figures"]
        assert figures["val_acc"] == figures["reference_acc"]
    assert items["recipes / dogcat on single"]["status"] == "passed"
    harness = [i for k, i in items.items() if k.startswith("throughput / same-process harness")]
    assert [h["status"] for h in harness] == ["passed", "skipped"]  # fp32 runs; bf16-mixed is the same harness
    assert harness[0]["figures"]["ratio"] > 0
    sharded = items["fsdp / fsdp against ddp, bf16-mixed: memory per rank"]
    assert sharded["status"] == "passed" and sharded["figures"]["comm"] == "gloo"
    assert sharded["figures"]["ratio"] <= 0.6, "2 processes: fsdp holds about half of ddp's model state"
    background = items["fsdp / sharded checkpoint in the background: the copies written, loaded exactly"]
    assert background["status"] == "passed" and background["figures"]["loaded_vs_saved"] == 0.0
    loop = items["host-sync / training loop on ddp"]
    assert loop["status"] == "passed" and loop["figures"]["step_ratio"] > 0
    # The GPT pair: recomputing the blocks replays dropout's draws, so in float32 it ends on its twin's bits.
    twin, recomputed = (items[f"transformers / gpt on fsdp{o}"] for o in ("", " --activation-checkpointing auto"))
    assert twin["status"] == recomputed["status"] == "passed"
    assert recomputed["figures"]["twin_val_loss"] == twin["figures"]["val_loss"] == recomputed["figures"]["val_loss"]


@pytest.mark.launcher
@pytest.mark.matrix  # 4 to 5 minutes of launches: make test-matrix (CI's time: docs/testing.md)
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S + 60)
def test_cuda_only_checks_are_listed_as_skipped(dry_run):
    _, _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["skipped_cuda_only"]) == sorted(CUDA_ONLY)
    items = {f"{n} / {i['name']}": i for n, s in summary["sections"].items() for i in s["items"]}
    for name in CUDA_ONLY:
        assert items[name]["status"] == "skipped" and items[name]["needs"] == "cuda"
    assert "CUDA only" in items["throughput / VGG16 224 px, 32/process, bf16-mixed"]["detail"]


# -------------------------------------------------- the check's machinery


def test_a_failing_step_is_recorded_and_the_others_still_run(tmp_path):
    machinery = load_script("gpu_check.check")
    check = machinery.Check(tmp_path / "out", tmp_path / "work", deadline=1e12, settings=machinery.DRY_RUN, nproc=2)

    def broken() -> machinery.Outcome:
        raise RuntimeError("boom")

    def skipped() -> machinery.Outcome:
        raise machinery.Skip("not here")

    def failed() -> machinery.Outcome:
        raise machinery.Fail("expected 1, got 2", log="the launch's output")

    check.step("recipes", "broken", broken)
    check.step("recipes", "skipped", skipped)
    check.step("recipes", "failed", failed)
    check.step("recipes", "fine", lambda: machinery.Outcome("ok", {"x": 1.0}))
    check.step("throughput", "too long", lambda: machinery.Outcome("never"), need_s=2e12)
    status = {i.name: (i.status, i.detail) for i in check.items}
    assert status["broken"] == ("failed", "RuntimeError: boom")
    assert status["skipped"] == ("skipped", "not here")
    assert status["failed"] == ("failed", "expected 1, got 2")
    assert status["fine"] == ("passed", "ok")
    assert status["too long"][0] == "skipped" and status["too long"][1].startswith("out of time")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["result"] == "failed" and summary["counts"] == {"passed": 1, "failed": 2, "skipped": 2}
    assert summary["sections"]["recipes"]["status"] == "failed"
    assert summary["sections"]["throughput"]["status"] == "skipped"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "**Result: FAILED**" in report and "RuntimeError: boom" in report and "the launch's output" in report


def test_synchronisations_per_step_verdict():
    """Judged on the counts the CUDA worker reports (per rank; the main rank's first)."""
    item = load_script("gpu_check.sections").sync_item

    def reports(px: float, plain: float | None, other: float = 0.0) -> list[dict]:
        loops = {"parallelx": {"syncs_per_step": px}} | ({} if plain is None else {"plain": {"syncs_per_step": plain}})
        return [{"loops": loops}, {"loops": {"parallelx": {"syncs_per_step": other}}}]

    ok = item("ddp", reports(0.1, 0.0))
    assert ok.status == "passed" and ok.needs == "cuda" and ok.figures["other_ranks_max"] == 0.0
    assert item("single", reports(0.1, None)).status == "passed"
    every_step = item("ddp", reports(1.1, 0.0))
    assert every_step.status == "failed" and ".item()" in every_step.detail
    # A framework that waits for the GPU every step by itself is not parallelx's doing.
    assert item("deepspeed", reports(1.1, 1.0)).status == "passed"


def test_precisions_are_options_parallelx_offers():
    """The check measures bf16-mixed, and passes each precision as parallelx's own ``--precision``."""
    import argparse

    import parallelx

    precisions = load_script("gpu_check.check").PRECISIONS
    assert precisions["fp32"] == () and precisions["bf16-mixed"] == ("--precision", "bf16-mixed")
    parser = parallelx.add_arguments(argparse.ArgumentParser(add_help=False))
    for extra in (e for e in precisions.values() if e):
        ns, rest = parser.parse_known_args(list(extra))
        assert not rest and ns.precision == extra[1]


def test_gpt_launches_parse_as_the_recipe_options(tmp_path):
    """Every GPT command line the transformers section can launch, on CUDA or in the dry run, parses as the
    recipe's, with the option it checks; the dry run runs only some of them."""
    from parallelx.recipes.gpt import build_parser

    check, sections = load_script("gpu_check.check"), load_script("gpu_check.sections")
    for settings in (check.CUDA, check.DRY_RUN):
        assert all(set(options) <= set(check.GPT_CASES[b]) for b, options in settings.gpt_cases.items())
        for backend, options in check.GPT_CASES.items():
            for option in options:
                target = sections.gpt_target(backend, option, settings, tmp_path)
                assert target[:2] == ["-m", "parallelx.recipes.gpt"]
                args = build_parser().parse_args(target[2:])
                assert args.backend == backend and args.epochs == 1 and args.sample_tokens == 0
                assert args.compile == (option == check.COMPILE)
                assert args.cpu_offload == (option == check.OFFLOAD)
                assert args.activation_checkpointing == ("auto" if option == check.CHECKPOINTING else None)
                assert args.tensor_parallel == (2 if option == check.TENSOR_PARALLEL else None)
                assert args.zero_stage == 3 or backend != "deepspeed"
                assert args.precision == ("bf16-mixed" if settings.cuda else None)  # None: float32


def test_gpu_check_sh_parses():
    res = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------- the wheels folder


def _fill(folder: Path, gpu_wheels: ModuleType) -> None:
    """Empty stand-ins for every file gpu_wheels.py would fetch."""
    folder.mkdir(exist_ok=True)
    for d in gpu_wheels.DISTS:
        name = {
            "build": f"{d.stem}-py3-none-any.whl",
            "sdist": f"{d.stem}.tar.gz",
            "download": f"{d.stem}-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        }[d.how]
        (folder / name).write_bytes(b"x" * 1000)
    (folder / "parallelx-0.2.0-py3-none-any.whl").write_bytes(b"x" * 1000)


def test_wheel_folder_check_finds_what_is_missing_doubled_foreign_or_too_big(tmp_path):
    gpu_wheels = load_script("gpu_wheels")
    folder = tmp_path / "gpu-wheels"
    assert gpu_wheels.check_folder(folder)[0].startswith(f"{folder} holds no wheels")
    _fill(folder, gpu_wheels)
    assert gpu_wheels.check_folder(folder) == []

    (folder / "pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl").unlink()
    (folder / "msgpack-1.2.3-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    (folder / "cffi-2.1.1-cp311-cp311-manylinux_2_17_aarch64.whl").write_bytes(b"")
    (folder / "numpy-2.4.6-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"")
    problems = "\n".join(gpu_wheels.check_folder(folder))
    assert "missing pydantic_core-2.50.5" in problems
    assert "2 files for msgpack-1.2.4" not in problems  # another version is not this one: it is foreign
    assert "unexpected file msgpack-1.2.3" in problems and "unexpected file numpy-2.4.6" in problems
    assert "2 files for cffi-2.1.1" in problems
    assert "cffi-2.1.1-cp311-cp311-manylinux_2_17_aarch64.whl is not for CPython 3.12" in problems

    _fill(folder, gpu_wheels)
    for extra in ("msgpack-1.2.3", "numpy-2.4.6", "cffi-2.1.1-cp311"):
        next(folder.glob(f"{extra}-*.whl")).unlink()
    assert gpu_wheels.check_folder(folder) == []
    assert "more than the 0 MiB allowed" in gpu_wheels.check_folder(folder, limit_mib=0.001)[0]
    assert "exceed 62 MiB" in gpu_wheels.check_folder(folder, tree_bytes=63 * 2**20)[0]


def test_wheel_tags_for_the_gpu_machine():
    ok = load_script("gpu_wheels").installable_on_target
    assert ok("deepspeed-0.19.8-py3-none-any.whl")
    assert ok("pydantic_core-2.50.5-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")
    assert ok("cryptography-46.0.0-cp311-abi3-manylinux_2_28_x86_64.whl")  # the stable ABI of an older 3.x
    assert not ok("pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert not ok("msgpack-1.2.4-cp312-cp312-manylinux_2_17_aarch64.whl")
    assert not ok("msgpack-1.2.4-cp312-cp312-win_amd64.whl")


def test_download_command_asks_for_cpython_312_manylinux_binaries_only(tmp_path):
    gpu_wheels = load_script("gpu_wheels")
    downloads = [d for d in gpu_wheels.DISTS if d.how == "download"]
    cmd = gpu_wheels.download_command(downloads, tmp_path, python="python")
    assert cmd[:4] == ["python", "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    assert "manylinux2014_x86_64" in cmd and "manylinux_2_28_x86_64" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path)
    assert set(cmd[cmd.index("-d") + 2 :]) == {d.requirement for d in downloads}
    assert {"pydantic==2.14.4", "pydantic-core==2.50.5", "hjson==3.1.0", "cffi==2.1.1"} <= set(cmd)
    # DeepSpeed is built here (pure Python, no ops), with this interpreter's torch.
    build = gpu_wheels.build_command(next(d for d in gpu_wheels.DISTS if d.name == "deepspeed"), tmp_path, "python")
    assert "--no-build-isolation" in build and build[-1] == "deepspeed==0.19.8"
