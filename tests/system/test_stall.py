"""A rank that stalls (alive, but never reaching the next collective) ends
the job after the configured timeout, on every backend (``tests/support/stall_worker.py``).

DDP relies on Gloo's own timeout; Horovod's Gloo controller and DeepSpeed's
CPU all-reduce wait for ever by themselves, so parallelx's watchdog ends the
waiting rank, and the launcher then stops the stalled one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from launching import BIN, ROOT, launch, launcher_for, require_launcher

from parallelx.launching.launchers import free_port
from parallelx.parts.watchdog import EXIT_STALLED

TIMEOUT_S = 6
# Start-up (DeepSpeed's is ~15 s on 2 busy cores), then the timeout, then the launcher's clean-up.
ENDS_WITHIN_S = 90

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(180)]

# Where the framework alone waits for ever (measured before the watchdog: a
# sleeping peer kept Horovod's all-reduce waiting the whole 120 s; a SIGSTOPped
# one kept a DeepSpeed recipe hanging): Horovod's Gloo controller and
# DeepSpeed's shared-memory all-reduce (ZeRO 0-2).  DDP and ZeRO-3's
# reduce-scatter go through Gloo, whose own timeout ends them (DDP:
# tests/system/test_failures.py).
CASES = {
    "horovod": ("horovodrun", "horovod", []),
    "deepspeed-zero0": ("deepspeed", "deepspeed", ["--zero-stage", "0"]),
}


# DeepSpeed's rank is frozen from outside below; a sleeping one is the same wait.
@pytest.mark.parametrize("case", ["horovod"])
def test_sleeping_rank_ends_the_job(case, tmp_path):
    launcher, backend, extra = CASES[case]
    require_launcher(launcher)
    res = launch(
        launcher,
        [
            "tests/support/stall_worker.py",
            "--backend",
            backend,
            *extra,
            "--timeout",
            str(TIMEOUT_S),
            "--out",
            str(tmp_path),
            "--freeze",
            "sleep",
        ],
        timeout=ENDS_WITHIN_S + 60,
    )
    assert res.returncode != 0, res.tail()
    assert res.seconds < ENDS_WITHIN_S, f"the job took {res.seconds:.0f}s to end:\n{res.tail()}"
    assert "another rank is stalled or gone" in res.output, res.tail()
    assert f"exit status {EXIT_STALLED}" in res.output


@pytest.mark.parametrize("case", ["deepspeed-zero0"])
def test_rank_frozen_from_outside_ends_the_job(case, tmp_path):
    """SIGSTOP from outside, as a debugger or a swapping machine would."""
    launcher, backend, extra = CASES[case]
    require_launcher(launcher)
    spec = launcher_for(launcher)
    port = free_port()
    cmd = spec.command(
        [
            "tests/support/stall_worker.py",
            "--backend",
            backend,
            *extra,
            "--timeout",
            str(TIMEOUT_S),
            "--out",
            str(tmp_path),
            "--freeze",
            "external",
        ],
        2,
        port=port,
    )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        **spec.env(),
    }
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    pid_file = tmp_path / "rank1.pid"
    try:
        deadline = time.monotonic() + 90
        while not pid_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert pid_file.exists(), "rank 1 never started training"
        time.sleep(2)  # a few steps in
        os.kill(int(pid_file.read_text()), signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job still ran {ENDS_WITHIN_S}s after rank 1 was frozen")
        ended = time.monotonic() - frozen
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if spec.cleanup is not None:
            spec.cleanup(port)
    assert proc.returncode != 0
    assert "another rank is stalled or gone" in out, out[-3000:]
    assert ended < TIMEOUT_S + 45, f"ended {ended:.0f}s after the freeze"


def test_fsdp_rank_asleep_ends_the_job_in_the_sharded_forward(tmp_path):
    """fsdp's own collectives (the forward's all-gather, the backward's reduce-scatter) run
    on the process group, whose timeout ends the waiting rank; torchrun then stops the other."""
    require_launcher("torchrun")
    res = launch(
        "torchrun",
        [
            "tests/support/stall_worker.py",
            "--backend",
            "fsdp",
            "--timeout",
            str(TIMEOUT_S),
            "--out",
            str(tmp_path),
            "--freeze",
            "sleep",
        ],
        timeout=ENDS_WITHIN_S + 60,
    )
    assert res.returncode != 0, res.tail()
    assert res.seconds < ENDS_WITHIN_S, f"the job took {res.seconds:.0f}s to end:\n{res.tail()}"
    assert "step 2" in res.output and "step 3" not in res.output, res.tail()
    assert "timed out" in res.output.lower() or "timeout" in res.output.lower(), res.tail()
