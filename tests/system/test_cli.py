"""The package and its command line as a user meets them, each in a fresh
process: what `import parallelx` loads, `python -m parallelx env` and
`launch`, the wheel's contents."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from launching import ROOT

import parallelx


def test_import_parallelx_imports_no_heavy_backend_package():
    # Every process reads every backend's options (parallelx.add_arguments): none of them may cost the start-up
    # of a backend it does not run (FSDP2 with DTensor is about a second; DeepSpeed, Horovod more).
    code = (
        "import argparse, sys, parallelx, parallelx.backends.horovod, parallelx.backends.deepspeed, "
        "parallelx.registry as r\n"
        "r.available_backends(); r.detect_backend({}, [])\n"
        "parallelx.add_arguments(argparse.ArgumentParser())\n"
        "heavy = ('horovod', 'deepspeed', 'torch.distributed.fsdp', 'torch.distributed.tensor', "
        "'torch.distributed.checkpoint', 'torch.utils.flop_counter', 'triton')\n"
        "bad = [m for m in sys.modules if m.startswith(heavy)]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_env_probes_share_one_interpreter_and_a_crash_is_pinned_on_its_own_backend():
    from parallelx.launching import envreport

    codes = {
        "fine": "print('noise'); print('fine 1.0')",
        "raises": "raise ImportError('libfoo.so: cannot open shared object file')",
        "crashes": "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
        "after": "print('after the crash')",
    }
    got = envreport._probe_all(codes)
    assert got["fine"] == (True, "fine 1.0")
    assert got["raises"] == (False, "ImportError: libfoo.so: cannot open shared object file")
    # The crash ends the shared interpreter: it and the probes after it run again, one per process.
    assert got["crashes"][0] is False and got["crashes"][1].startswith("exit code")
    assert got["after"] == (True, "after the crash")


def test_env_report_lists_every_backend():
    proc = subprocess.run(
        [sys.executable, "-m", "parallelx", "env"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert f"torch       {torch.__version__}" in proc.stdout
    for name in ("single", "dp", "ddp", "horovod", "deepspeed"):
        assert any(line.split()[1:2] == [name] for line in proc.stdout.splitlines() if "]" in line), name


@pytest.mark.timeout(300)
def test_the_wheel_installs_nothing_generic_at_top_level(tmp_path):
    import zipfile

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("parallelx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"parallelx"}, top
    for module in (
        "parallelx/backends/deepspeed.py",
        "parallelx/recipes/dogcat.py",
        "parallelx/launching/launchers.py",
    ):
        assert module in names


def test_launch_command_comes_from_the_backends_declaration(capsys):
    from parallelx.__main__ import main

    # In this process (the dry run starts nothing); the command line's own exit below runs as users run it.
    # Horovod's launcher where it is installed (make setup builds it; make test's set-up does not).
    installed = parallelx.describe("horovod").launcher.program_path() is not None
    for name in ("ddp", "horovod", "deepspeed", "single") if installed else ("ddp", "deepspeed", "single"):
        capsys.readouterr()
        assert main(["launch", name, "-n", "3", "--dry-run", "--", "-m", "recipes.cifar10", "--epochs", "1"]) == 0
        expected = parallelx.describe(name).launcher.command(
            ["-m", "recipes.cifar10", "--epochs", "1", "--backend", name], 3 if name != "single" else 1, port=1
        )
        got = capsys.readouterr().out.split()
        # Same command but for the free port each call picks.
        assert [w for w in got if not w.isdigit()] == [w for w in expected if not w.isdigit()], got
    proc = subprocess.run(
        [sys.executable, "-m", "parallelx", "launch", "ddp"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 2 and "nothing to launch" in proc.stderr and "Traceback" not in proc.stderr
