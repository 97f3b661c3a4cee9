"""The CIFAR-10 recipe as a Ray Train job (``python -m parallelx.launching.ray_train``, 2 CPU
workers) in a real local Ray cluster, started once for every job here by
tests/support/ray_driver.py: ddp with a worker SIGKILLed after the first
checkpoint (Ray replaces the worker group, ``FailureConfig(max_failures=1)``,
and the run resumes), then deepspeed.  Both end with the torchrun reference's
weights, bit for bit, and every checkpoint reached Ray's storage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from engines import ARGS, assert_bitwise, assert_exact_metrics, job_env, rel_err, resumed_from, run, weights
from launching import ROOT, latest_step, wait_for

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(300)]


def test_ray_train_workers_replaced_after_a_kill_resume_bitwise_and_deepspeed_matches(
    engine_data, engine_reference, tmp_path
):
    pytest.importorskip("ray.train", reason="Ray Train is not installed (pip install 'parallelx[ray]')")
    ddp, ds, pids, storage = tmp_path / "ddp", tmp_path / "deepspeed", tmp_path / "pids", tmp_path / "ray"
    common = ["-n", "2", "--cpus-per-worker", "1", "--storage", str(storage), "--timeout", "120"]
    jobs = [
        [
            *common,
            "--name",
            "ddp",
            "--max-failures",
            "1",
            "tests/support/resume_wrapper.py",
            "--backend",
            "ddp",
            "--data-dir",
            str(engine_data),
            "--out-dir",
            str(ddp),
            "--checkpoint-every",
            "1",
            "--resume",
            "auto",
            *ARGS,
        ],
        [
            *common,
            "--name",
            "deepspeed",
            "-m",
            "recipes.cifar10",
            "--backend",
            "deepspeed",
            "--zero-stage",
            "2",
            "--data-dir",
            str(engine_data),
            "--out-dir",
            str(ds),
            *ARGS,
        ],
    ]
    killed = {}

    def kill_a_worker(proc: subprocess.Popen) -> None:
        wait_for(lambda: latest_step(ddp) >= 1, proc, "the first checkpoint", timeout=150)
        pid = int((pids / "rank1-attempt0.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        killed.update(pid=pid, step=latest_step(ddp))

    # The controller polls its workers every 0.5 s instead of 2 (how soon a finished or dead worker is seen);
    # no preemption watcher (one actor less to start).
    env = job_env(
        PXT_DELAY="0.3",
        PXT_PIDS=str(pids),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5",
        RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
    )
    rc, output = run(
        [sys.executable, str(ROOT / "tests/support/ray_driver.py"), json.dumps(jobs)],
        env,
        tmp_path / "driver.log",
        timeout=280,
        while_running=kill_a_worker,
    )
    timing = [ln for ln in output.splitlines() if ln.startswith("ray_driver:")]
    print("\n".join(timing))
    assert rc == 0, output[-5000:]
    assert int((pids / "rank1-attempt0.pid").read_text()) != killed["pid"], "Ray did not replace the worker"
    # The replacement resumed from a checkpoint at or after the one seen before the kill.
    resumed = [Path(p).name for p in resumed_from(output) if p.startswith(str(ddp))]
    assert resumed and int(resumed[-1].split("-")[1]) >= killed["step"], output[-4000:]
    assert_exact_metrics(ddp, engine_data, "ddp", 2)
    assert_bitwise(ddp, engine_reference)
    # The checkpoints reached Ray's storage, each a whole training state (every rank's files), the last
    # one the run's end.
    kept = sorted(p for p in (storage / "ddp").glob("checkpoint_*") if p.is_dir())
    assert kept and all((k / "state.pt").is_file() and (k / "rng-rank1.pt").is_file() for k in kept), kept
    assert f"latest checkpoint reported: {kept[-1]}" in output

    assert_exact_metrics(ds, engine_data, "deepspeed", 2)
    err = rel_err(weights(ds), weights(engine_reference))
    print(f"deepspeed ZeRO-2 under Ray vs ddp under torchrun: relative error {err:.3g}")
    assert err < 1e-6, f"deepspeed ZeRO-2 under Ray: relative error {err:.3g} from ddp's weights"
