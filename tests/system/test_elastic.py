"""Elastic Horovod: a worker killed with SIGKILL does not end the job.

``horovodrun --min-np 1 --max-np 2 --host-discovery-script`` runs
tests/support/elastic_worker.py on this machine under two host names (``localhost``
and ``127.0.0.1``, one slot each): Horovod blacklists the whole host of a
failed worker, so with a single name the job would end with its first loss.
One of the two workers is SIGKILLed in the first epoch (by itself, or by the
test from outside); the other must rejoin a world of one, resume from the
last training-state checkpoint on disk and finish with exit status 0, every
sample of each epoch trained on exactly once by the committed steps of the
old world and the steps of the new one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from launching import BIN, ROOT, require_launcher

import parallelx

SAMPLES, BATCH, EPOCHS, COMMIT_EVERY = 64, 4, 2, 3


def test_run_elastic_calls_train_once_outside_an_elastic_run() -> None:
    calls = []
    backend = parallelx.get_backend("single")
    with pytest.raises(parallelx.ParallelxError, match="not initialised"):
        backend.run_elastic(lambda: None)
    with backend:
        result = backend.run_elastic(lambda: calls.append(backend.world_size) or "done")
        backend.elastic_commit()  # nothing to commit to: no error
    assert result == "done" and calls == [1]


def elastic_job(tmp: Path, worker_args: list[str], while_running=None, timeout: float = 90) -> tuple[int, str]:
    require_launcher("horovodrun")
    discover = tmp / "discover.sh"
    # One machine under two names: a host per worker, so the blacklisting of
    # the failed worker's host leaves the other one.
    discover.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    discover.chmod(0o755)
    (tmp / "logs").mkdir()
    cmd = [
        str(BIN / "horovodrun"),
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--host-discovery-script",
        str(discover),
        "--gloo",
        "--network-interface",
        "lo",
        str(BIN / "python"),
        "tests/support/elastic_worker.py",
        "--run-dir",
        str(tmp / "run"),
        "--log-dir",
        str(tmp / "logs"),
        "--samples",
        str(SAMPLES),
        "--batch-size",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        "--commit-every",
        str(COMMIT_EVERY),
        *worker_args,
    ]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
        GLOO_SOCKET_IFNAME="lo",
        PARALLELX_TIMEOUT="60",
        HOROVOD_ELASTIC_TIMEOUT="30",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        if while_running is not None:
            while_running(tmp / "logs")
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("the elastic job did not finish:\n" + "\n".join(out.splitlines()[-40:]))
    return proc.returncode, out


def read_records(logs: Path) -> list[dict]:
    records = []
    for path in logs.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a SIGKILLed writer may leave half a line
                records.append(json.loads(line))
    return records


def check_survived(tmp: Path, rc: int, out: str) -> dict[str, float]:
    """The checks common to both ways of killing; returns measured times."""
    tail = "\n".join(out.splitlines()[-30:])
    assert rc == 0, f"the elastic job failed (exit status {rc}):\n{tail}"
    assert "exit with status code 137" in out, f"no worker was killed:\n{tail}"
    records = read_records(tmp / "logs")
    first = [r for r in records if r["event"] == "start" and r["attempt"] == 1]
    assert len(first) == 2 and {r["world"] for r in first} == {2}, first
    again = [r for r in records if r["event"] == "start" and r["attempt"] > 1]
    assert len(again) == 1, f"expected one restart of train() (the survivor's), got {again}"
    resumed = again[0]
    survivor, committed = resumed["pid"], resumed["from_step"]
    assert resumed["world"] == 1 and resumed["rank"] == 0
    # The surviving process itself resumed, from the checkpoint on disk of its last commit.
    assert any(r["pid"] == survivor and r["attempt"] == 1 for r in records)
    assert committed > 0 and resumed["checkpoint"] == f"step-{committed:08d}"
    old = [r for r in records if r["event"] == "step" and r["attempt"] == 1]
    new = [r for r in records if r["event"] == "step" and r["attempt"] == 2]
    assert {r["pid"] for r in new} == {survivor} and all(r["world"] == 1 for r in new)
    assert any(r["step"] > committed for r in old), "no uncommitted step was rolled back"
    assert min(r["step"] for r in new) == committed + 1
    # Every sample of each epoch exactly once: the old world's committed steps, then the new world's.
    for epoch in range(EPOCHS):
        seen = Counter(
            i
            for r in old + new
            if r["epoch"] == epoch and (r["attempt"] == 2 or r["step"] <= committed)
            for i in r["idx"]
        )
        assert seen == Counter(range(SAMPLES)), (
            f"epoch {epoch}: samples missing or repeated: "
            f"{sorted(set(range(SAMPLES)) - set(seen))} missing, {[i for i, n in seen.items() if n > 1]} repeated"
        )
    # The final training state is on disk, written by the world of one.
    done = [r for r in records if r["event"] == "done"]
    assert [r["pid"] for r in done] == [survivor]
    final = parallelx.latest_checkpoint(tmp / "run")
    assert final is not None and final.name == f"step-{done[0]['step']:08d}"
    state = torch.load(final / "state.pt", weights_only=True)
    assert state["meta"]["world_size"] == 1 and state["sampler"]["epoch"] == EPOCHS
    lost_at = max(r["time"] for r in old)
    return {"recovery_s": resumed["time"] - lost_at}


@pytest.mark.launcher
@pytest.mark.scenario
@pytest.mark.timeout(120)
def test_worker_killing_itself_does_not_end_the_job(tmp_path: Path) -> None:
    # Rank 1 dies after step 5; the last commit was at step 3.
    start = time.monotonic()
    rc, out = elastic_job(tmp_path, ["--kill-step", "5"])
    times = check_survived(tmp_path, rc, out)
    resumed = [r for r in read_records(tmp_path / "logs") if r["event"] == "start" and r["attempt"] == 2]
    assert resumed[0]["from_step"] == 3
    print(f"elastic job with a kill from inside: {time.monotonic() - start:.1f}s, recovery {times['recovery_s']:.1f}s")


@pytest.mark.launcher
@pytest.mark.scenario
@pytest.mark.timeout(120)
def test_worker_killed_from_outside_does_not_end_the_job(tmp_path: Path) -> None:
    # Rank 0 this time (rank 1 kills itself above): the survivor becomes rank 0 of the new world.
    def kill_rank0(logs: Path) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            steps = [r for r in read_records(logs) if r["event"] == "step" and r["world"] == 2 and r["rank"] == 0]
            if any(r["step"] >= 4 for r in steps):
                os.kill(steps[0]["pid"], signal.SIGKILL)
                return
            time.sleep(0.05)
        raise AssertionError("rank 0 never reached step 4")

    start = time.monotonic()
    rc, out = elastic_job(tmp_path, ["--step-sleep", "0.1"], while_running=kill_rank0)
    times = check_survived(tmp_path, rc, out)
    print(f"elastic job with a kill from outside: {time.monotonic() - start:.1f}s, recovery {times['recovery_s']:.1f}s")


@pytest.mark.launcher
@pytest.mark.scenario
@pytest.mark.timeout(150)
def test_the_recipe_survives_a_killed_worker(tmp_path):
    """The CIFAR-10 recipe itself under elastic horovodrun: rank 1 is SIGKILLed
    after its 3rd step (a checkpoint was committed at step 2); rank 0 goes on
    as a world of 1 from that checkpoint and the job ends with exit status 0."""
    from recipes.make_data import make_cifar10

    require_launcher("horovodrun")
    data = tmp_path / "cifar"
    make_cifar10(data, n_train=128, n_test=32, seed=0)
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    discover.chmod(0o755)
    out = tmp_path / "out"
    cmd = [
        str(BIN / "horovodrun"),
        "-np",
        "2",
        "--min-np",
        "1",
        "--max-np",
        "2",
        "--host-discovery-script",
        str(discover),
        "--gloo",
        "--network-interface",
        "lo",
        str(BIN / "python"),
        "tests/support/resume_wrapper.py",
        "--backend",
        "horovod",
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--epochs",
        "2",
        "--batch-size",
        "16",
        "--num-workers",
        "0",
        "--checkpoint-every",
        "2",
    ]
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME="lo",
        PARALLELX_TIMEOUT="60",
        HOROVOD_ELASTIC_TIMEOUT="30",
        PXT_ACTIONS="0:kill@3:1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "resume_wrapper: rank 1 attempt 0: SIGKILL after step 3" in proc.stdout
    assert "resuming from " in proc.stdout and "step-00000002" in proc.stdout, proc.stdout[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 1  # the survivors' world, which finished the run
    assert (out / "last.pth").is_file()
