"""Checkpoints and resuming of the recipes, and surviving failures, under the
real launchers (CIFAR-10 recipe, 256 generated images, 2 epochs of 4
optimizer steps: 2 processes x 16 images x --accumulate 2, a cosine schedule
with warm-up; and once the Dogs-vs-Cats recipe).

The reference is one uninterrupted ``torchrun`` run without any checkpoint
option.  Faults come from ``tests/support/resume_wrapper.py`` (the recipe with a
SIGKILL or SIGTERM injected at a chosen point of a chosen attempt and rank)
or from the test itself (SIGKILL to a rank, SIGTERM to the launcher):

- same backend and world size: ``last.pth`` bitwise equal, ``history.csv``
  equal but for its timing columns;
- across backends (deepspeed ZeRO-3 -> horovod -> ddp, deepspeed ZeRO-2
  under torchrun): within REL_TOL_BACKEND;
- across world sizes (2 -> 1 -> 2 processes, the global batch kept):
  every sample of each epoch trained on exactly once, weights within
  REL_TOL_WORLD;
- a checkpoint that cannot be honoured: one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from launching import BIN, ROOT, latest_step, launcher_for, rel_err, require_launcher, wait_for

from parallelx.launching.launchers import free_port

EPOCHS, N_TRAIN, N_TEST = 2, 256, 32
ARGS = [
    "--epochs",
    str(EPOCHS),
    "--lr",
    "0.05",
    "--accumulate",
    "2",
    "--lr-schedule",
    "cosine",
    "--warmup-epochs",
    "0.5",
]
# Across backends only the order of float additions in the gradient average differs (2.8e-8 measured).
REL_TOL_BACKEND = 1e-6
# Across world sizes the global batch is the same samples (2 x 16 or 1 x 32) but
# the mean is taken in another order: float32 rounding (measured 1.1e-8).
REL_TOL_WORLD = 1e-6
TIMING = ("epoch_time_s", "train_images_per_s", "val_images_per_s")

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from recipes.make_data import make_cifar10

    out = tmp_path_factory.mktemp("cifar")
    make_cifar10(out, n_train=N_TRAIN, n_test=N_TEST, seed=0)
    return out


def job(
    launcher: str,
    args: list[str],
    out: Path,
    data: Path,
    *,
    nproc: int = 2,
    restarts: int | None = None,
    batch: int = 16,
    workers: int = 0,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    while_running=None,
    wrapper: bool = True,
    url: str | None = None,
) -> tuple[int, str]:
    """Run the recipe (through the fault wrapper) under ``launcher``; return (exit status, output).
    ``url``: the ``--out-dir`` (an object store's), ``out`` then only names the log.
    ``timeout`` (a hang's guard, not a measure): by default 150 s and 60 more per restart, since each
    attempt starts its launcher and ranks again (a 4-attempt job took over 150 s on CI's loaded 2 cores)."""
    require_launcher(launcher)
    if timeout is None:
        timeout = 150 + 60 * (restarts or 0)
    spec = launcher_for(launcher)
    port = free_port()
    target = "tests/support/resume_wrapper.py" if wrapper else "recipes/cifar10.py"
    cmd = spec.command(
        [
            target,
            "--data-dir",
            str(data),
            "--out-dir",
            url or str(out),
            "--batch-size",
            str(batch),
            "--num-workers",
            str(workers),
            *ARGS,
            *args,
        ],
        nproc,
        port=port,
    )
    if restarts is not None:
        cmd[1:1] = ["--max-restarts", str(restarts)]
    full = dict(os.environ)
    full.update(
        PYTHONUNBUFFERED="1",
        PARALLELX_TIMEOUT="60",
        PYTHONFAULTHANDLER="1",
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        **spec.env(),
        **(env or {}),
    )
    log = out.parent / f"{out.name}-{time.monotonic_ns()}.log"
    # Output to a file: ranks live in sessions of their own (torchrun's) and a
    # pipe would stay open as long as any of them does.
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=full, stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    try:
        if while_running is not None:
            while_running(proc)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"{' '.join(cmd[:4])} hung for more than {timeout:.0f}s:\n" + tail(log))
    finally:
        kill_tree(proc.pid)
        cleanup = launcher_for("deepspeed").cleanup
        if cleanup is not None:  # a SIGKILLed deepspeed rank leaves its shared-memory buffers
            cleanup(port)
    output = log.read_text(errors="replace").replace("\r", "\n")
    return proc.returncode, output


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (ranks, loader workers), if any is left."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def tail(log: Path, n: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").replace("\r", "\n").splitlines()[-n:])


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "last.pth", weights_only=True)


def assert_bitwise(out: Path, ref: Path) -> None:
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys()
    bad = [k for k in b if not torch.equal(a[k], b[k])]
    assert not bad, f"last.pth differs from the uninterrupted run's in {bad} (rel. error {rel_err(a, b):.3g})"
    assert history(out) == history(ref), "history.csv differs from the uninterrupted run's"


def history(out: Path) -> list[dict[str, str]]:
    with open(out / "history.csv") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def resumed_from(output: str) -> list[str]:
    return [
        line.split("resuming from ", 1)[1].split(": ", 1)[0].rsplit("/", 1)[1]
        for line in output.splitlines()
        if "resuming from " in line
    ]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> Path:
    """The uninterrupted run: the plain recipe under torchrun, no checkpoint option."""
    out = tmp_path_factory.mktemp("reference")
    rc, output = job("torchrun", [], out, data, wrapper=False)
    assert rc == 0, output[-3000:]
    assert not (out / "checkpoints").exists(), "no checkpoint option: no checkpoints"
    return out


@pytest.mark.timeout(480)  # four attempts, each guarded by job()'s timeout
def test_torchrun_restarts_after_kills_anywhere_and_ends_bitwise_equal(data, reference, tmp_path):
    """One job, three failures, each on its own attempt, with a loader worker per process:
    attempt 0 loses rank 1 after step 3; attempt 1 loses rank 0 half-way through writing
    its checkpoint file (epoch 1's last); attempt 2 loses rank 1 at the start of epoch 2's
    validation; attempt 3 finishes."""
    out = tmp_path / "out"
    rc, output = job(
        "torchrun",
        ["--checkpoint-every", "1", "--resume", "auto", "--keep-checkpoints", "2"],
        out,
        data,
        restarts=3,
        workers=1,
        env={"PXT_ACTIONS": "0:kill@3:1;1:write@4:0;2:val@2:1"},
    )
    assert rc == 0, output[-4000:]
    for why in (
        "rank 1 attempt 0: SIGKILL after step 3",
        "rank 0 attempt 1: SIGKILL while writing",
        "rank 1 attempt 2: SIGKILL at the start of validation pass 2",
    ):
        assert why in output, f"the fault was not injected: {why}"
    # Attempt 1 wrote step 3 and died writing step 4's state.pt: step 3 survived and was taken.
    assert resumed_from(output) == ["step-00000002", "step-00000003", "step-00000007"]
    assert_bitwise(out, reference)
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert left == ["latest", "step-00000007", "step-00000008"], left  # kept 2, half-written ones removed


def test_dogcat_recipe_killed_from_outside_restarts_and_ends_bitwise_equal(tmp_path):
    """The other recipe (VGG16 fine-tuning, 32 px, a loader worker per process):
    rank 1 SIGKILLed from outside after the first checkpoint; torchrun restarts
    both, they resume, and last.pth and history.csv equal the uninterrupted run's."""
    from recipes.make_data import make_dogcat

    dogcat = make_dogcat(tmp_path / "dogcat", n_per_class=13, seed=0, csv=True)  # 21 train, 5 val
    args = ["--image-size", "32", "--lr", "0.001", "--epochs", "1"]  # 3 micro-batches, 2 steps (accumulate 2)
    env = {"PXT_RECIPE": "dogcat"}
    ref = tmp_path / "ref"
    rc, output = job("torchrun", args, ref, dogcat, batch=4, workers=1, env=env)
    assert rc == 0, output[-3000:]

    out, pids = tmp_path / "out", tmp_path / "pids"

    def kill_rank_1(proc: subprocess.Popen) -> None:
        wait_for(lambda: latest_step(out) >= 1, proc, "the first checkpoint")
        os.kill(int((pids / "rank1-attempt0.pid").read_text()), signal.SIGKILL)

    # One checkpoint kept: each holds VGG16's weights and momentum, about 1 GB.
    rc, output = job(
        "torchrun",
        [*args, "--checkpoint-every", "1", "--keep-checkpoints", "1", "--resume", "auto"],
        out,
        dogcat,
        batch=4,
        workers=1,
        restarts=1,
        env={**env, "PXT_DELAY": "0.5", "PXT_PIDS": str(pids)},
        while_running=kill_rank_1,
    )
    assert rc == 0, output[-4000:]
    assert (pids / "rank1-attempt1.pid").exists(), "the workers were not restarted"
    assert resumed_from(output) == ["step-00000001"], output[-3000:]  # mid-epoch
    assert_bitwise(out, ref)


def test_deepspeed_backend_under_torchrun_survives_a_killed_rank(data, reference, tmp_path):
    require_launcher("deepspeed")
    out = tmp_path / "out"
    rc, output = job(
        "torchrun",
        ["--backend", "deepspeed", "--zero-stage", "2", "--checkpoint-every", "2", "--resume", "auto"],
        out,
        data,
        restarts=1,
        env={"PXT_ACTIONS": "0:kill@6:1"},
    )
    assert rc == 0, output[-4000:]
    assert "backend=deepspeed world_size=2" in output
    assert resumed_from(output) == ["step-00000004"]  # the epoch-1 end; step 6 died before its save
    err = rel_err(weights(out), weights(reference))
    print(f"relative error of last.pth against the uninterrupted ddp run: {err:.3g}")
    assert err < REL_TOL_BACKEND, f"deepspeed ZeRO-2 resumed vs ddp uninterrupted: {err:.3g}"


def test_fsdp_with_sharded_checkpoints_survives_a_kill_and_a_preemption(data, reference, tmp_path):
    """fsdp under torchrun --max-restarts, every rank writing its shards: attempt 0
    loses rank 1 after step 6, attempt 1 resumes from epoch 1's end and gets SIGTERM
    on rank 0 after one step (saved together, exit 0); the next launch resumes to the
    end.  fsdp's update is ddp's to the bit, so the run ends with the uninterrupted ddp
    run's weights, bit for bit."""
    out = tmp_path / "out"
    args = ["--backend", "fsdp", "--fsdp-sharded-checkpoints", "--checkpoint-every", "2", "--resume", "auto"]
    rc, output = job("torchrun", args, out, data, restarts=1, env={"PXT_ACTIONS": "0:kill@6:1;1:term@1:0"})
    assert rc == 0, output[-4000:]
    assert "backend=fsdp world_size=2" in output and "preempted (SIGTERM)" in output, output[-3000:]
    assert resumed_from(output) == ["step-00000004"]  # the epoch-1 end; step 6 died before its save
    assert latest_step(out) == 5 and (out / "checkpoints" / "step-00000005" / "shards" / ".metadata").is_file()
    rc, output = job("torchrun", args, out, data, wrapper=False)
    assert rc == 0, output[-3000:]
    assert resumed_from(output) == ["step-00000005"]
    a, b = weights(out), weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in b), f"last.pth differs from ddp's: {rel_err(a, b):.3g}"
    # Unclipped, fsdp takes the reported norm from its slices' squares: ddp's within 1e-6, not to the bit.
    mine, ref = history(out), history(reference)
    assert [{k: v for k, v in r.items() if k != "grad_norm"} for r in mine] == [
        {k: v for k, v in r.items() if k != "grad_norm"} for r in ref
    ]
    assert [float(r["grad_norm"]) for r in mine] == pytest.approx([float(r["grad_norm"]) for r in ref], rel=1e-6)


def test_sigterm_to_torchrun_saves_together_and_the_next_launch_resumes(data, reference, tmp_path):
    out = tmp_path / "out"
    times = {}

    def preempt(proc: subprocess.Popen) -> None:
        wait_for(lambda: latest_step(out) >= 4, proc, "epoch 1's checkpoint")
        times["sent"] = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # torchrun's agent: it forwards SIGTERM to every worker
        proc.wait(60)
        times["ended"] = time.monotonic()

    rc, output = job("torchrun", ["--resume", "auto"], out, data, env={"PXT_DELAY": "0.3"}, while_running=preempt)
    assert "preempted (SIGTERM): checkpoint written at epoch 2" in output, output[-3000:]
    assert times["ended"] - times["sent"] < 20, "the workers did not stop within a step or two"
    assert not (out / "last.pth").exists()
    # Step 4 itself when the SIGTERM arrived between epoch 1's end checkpoint and
    # the check right after it (nothing new to save then), else a step of epoch 2.
    assert latest_step(out) >= 4, "the preemption stops at or after epoch 1's checkpoint"
    saved = latest_step(out)
    rc, output = job("torchrun", ["--resume", "auto"], out, data, wrapper=False)
    assert rc == 0, output[-3000:]
    assert resumed_from(output) == [f"step-{saved:08d}"]
    assert_bitwise(out, reference)


def test_across_backends_zero3_then_horovod_then_ddp(data, reference, tmp_path):
    """Saved under deepspeed ZeRO-3 (SIGTERM to the deepspeed launcher, which passes it
    to its workers), continued under horovod (preempted on rank 1 only), ended under ddp."""
    require_launcher("deepspeed")
    require_launcher("horovodrun")
    out = tmp_path / "out"

    def preempt(proc: subprocess.Popen) -> None:
        import psutil

        wait_for(lambda: latest_step(out) >= 2, proc, "the first checkpoint")
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGTERM)  # the launcher's process group, as a shell's kill or a scheduler does
        _, alive = psutil.wait_procs(tree, timeout=60)  # the runner dies at once; its workers save first
        assert not alive, "workers still running a minute after SIGTERM"

    rc, output = job(
        "deepspeed",
        ["--backend", "deepspeed", "--zero-stage", "3", "--checkpoint-every", "2", "--resume", "auto"],
        out,
        data,
        env={"PXT_DELAY": "0.3"},
        while_running=preempt,
    )
    assert "preempted (SIGTERM)" in output, output[-3000:]
    first = latest_step(out)
    assert 2 <= first < 8
    rc, output = job(
        "horovodrun", ["--backend", "horovod", "--resume", "auto"], out, data, env={"PXT_ACTIONS": "0:term@1:1"}
    )
    assert rc == 0 and "preempted (a stop request on another rank)" in output, output[-3000:]
    assert "written by deepspeed with 2 process(es)" in output
    assert latest_step(out) == first + 1 or latest_step(out) == 4  # the next step, or epoch 1's end
    rc, output = job("torchrun", ["--resume", "auto"], out, data, wrapper=False)
    assert rc == 0, output[-3000:]
    assert "written by horovod with 2 process(es)" in output
    err = rel_err(weights(out), weights(reference))
    print(f"relative error of last.pth against the uninterrupted ddp run: {err:.3g}")
    assert err < REL_TOL_BACKEND, f"zero3 -> horovod -> ddp vs ddp uninterrupted: {err:.3g}"


def test_across_world_sizes_every_sample_once(data, reference, tmp_path):
    """2 processes (rank 1 alone gets SIGTERM after step 6) -> 1 process with the same
    global batch (SIGTERM after one step) -> 2 processes to the end."""
    out, logs = tmp_path / "out", tmp_path / "samples"
    env = {"PXT_SAMPLES": str(logs)}
    rc, output = job("torchrun", ["--resume", "auto"], out, data, env={**env, "PXT_ACTIONS": "0:term@6:1"})
    assert "preempted (a stop request on another rank)" in output and latest_step(out) == 6, output[-3000:]
    rc, output = job(
        "torchrun", ["--resume", "auto"], out, data, nproc=1, batch=32, env={**env, "PXT_ACTIONS": "0:term@1:0"}
    )
    assert "preempted (SIGTERM)" in output and latest_step(out) == 7, output[-3000:]
    assert "was written by 2 rank(s), this run has 1" in output
    rc, output = job("torchrun", ["--resume", "auto"], out, data, env=env)
    assert rc == 0, output[-3000:]
    seen: dict[int, Counter[int]] = {e: Counter() for e in range(1, EPOCHS + 1)}
    for f in logs.iterdir():
        for line in f.read_text().splitlines():
            epoch, *indices = map(int, line.split())
            seen[epoch].update(indices)
    for epoch, count in seen.items():
        assert sorted(count) == list(range(N_TRAIN)), f"epoch {epoch}: samples missed"
        twice = [i for i, c in count.items() if c > 1]
        assert not twice, f"epoch {epoch}: samples trained twice: {twice[:5]}"
    err = rel_err(weights(out), weights(reference))
    print(f"relative error of last.pth against the uninterrupted ddp run: {err:.3g}")
    assert err < REL_TOL_WORLD, f"2 -> 1 -> 2 processes vs 2 uninterrupted: {err:.3g}"


# ----------------------------------------------- what cannot be honoured
def _main(argv: list[str], capsys) -> tuple[int, str]:
    import recipes.cifar10

    try:
        code = recipes.cifar10.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_mismatches_fail_with_one_line(data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    base = [
        "--backend",
        "single",
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--num-workers",
        "0",
        "--max-steps",
        "2",
    ]
    code, err = _main([*base, "--checkpoint-every", "1"], capsys)
    assert code == 0, err
    ckpt = out / "checkpoints" / "step-00000002"
    assert ckpt.is_dir()

    def fails(argv: list[str], expected: str) -> None:
        code, err = _main(argv, capsys)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and expected in lines[0], err

    fails([*base, "--resume", str(tmp_path / "missing")], "no such checkpoint")
    import recipes.cifar10
    from recipes.models import LeNet

    with monkeypatch.context() as m:
        m.setattr(torch.optim, "SGD", lambda params, lr, momentum: torch.optim.Adam(params, lr=lr))
        fails([*base, "--resume", str(ckpt)], "holds the state of a SGD optimizer, this run uses Adam")
    with monkeypatch.context() as m:
        m.setattr(recipes.cifar10, "LeNet", lambda num_classes: LeNet(num_classes=7))
        fails([*base, "--resume", str(ckpt)], "does not fit this model")
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["extra"]["recipe"] = "dogcat"
    other = tmp_path / "other" / "step-00000002"
    shutil.copytree(ckpt, other)
    torch.save(state, other / "state.pt")
    fails([*base, "--resume", str(other)], "is of the 'dogcat' recipe, this is 'cifar10'")
    (other / "state.pt").write_bytes((ckpt / "state.pt").read_bytes()[:300])
    fails([*base, "--resume", str(other)], "cannot be read")
    # auto with nothing there: a fresh start, said in one line.
    code, _ = _main([*base, "--out-dir", str(tmp_path / "fresh"), "--resume", "auto"], capsys)
    assert code == 0


def test_preemption_module_agrees_and_restores_the_handler():
    import parallelx

    before = signal.getsignal(signal.SIGTERM)
    backend = parallelx.get_backend("single")
    backend.init()
    with parallelx.Preemption() as p:
        assert p.active and not p.should_stop(backend)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert p.requested and p.should_stop(backend) and p.signal == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    backend.shutdown()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.timeout(600)  # two launches, the first with a restart
def test_async_checkpoints_in_the_store_survive_a_kill_a_slow_store_and_a_stopped_one(
    data, reference, tmp_path, s3_env
):
    """The recipe with its outputs and checkpoints in an S3-compatible store (SeaweedFS, started by
    the tests) and the checkpoints written in the background, under torchrun, through the store's
    faults: rank 1 is SIGKILLed after step 3 and torchrun restarts both ranks, ``--resume auto``
    finding the latest complete checkpoint in the store; in the restarted attempt the store stops
    answering for 3 s during a save (a slow store: training goes on, the save completes), then its
    server is stopped during the saves that follow (the retries give up: the job ends with a line
    naming the store's URL and the cause).  The store started again, the next launch's ``--resume
    auto`` continues from the latest complete checkpoint (never a partial one) and the run ends on
    the uninterrupted run's weights and history, to the bit."""
    store, bucket = s3_env
    url = f"s3://{bucket}/run"
    args = ["--checkpoint-every", "1", "--checkpoint-async", "--resume", "auto", "--keep-checkpoints", "2"]
    faults: list[str] = []

    client = store.client()

    def committed(step: int, proc: subprocess.Popen[str]) -> bool:
        """Wait until step's checkpoint is complete in the store; False if the job ended first."""
        key = f"run/checkpoints/step-{step:08d}/commit.json"
        while proc.poll() is None:
            if client.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"):
                return True
            time.sleep(0.2)
        return False

    def store_faults(proc: subprocess.Popen[str]) -> None:
        if committed(4, proc):  # attempt 1's first new checkpoint (attempt 0 died after step 3)
            store.freeze(3.0)
            faults.append("slow")
        if committed(5, proc):  # the training went on past the slow store; 3 steps and the end still to go
            store.halt()
            faults.append("stopped")

    try:
        rc, output = job(
            "torchrun",
            args,
            tmp_path / "out",
            data,
            restarts=1,
            url=url,
            # Each store call tried 3 times (1.5 s of waits), not 5 (7.5 s): the stopped store fails the job sooner.
            env={"PXT_ACTIONS": "0:kill@3:1", "PXT_DELAY": "1:1.5", "PARALLELX_STORE_ATTEMPTS": "3"},
            while_running=store_faults,
        )
    finally:
        store.restart()
    assert faults == ["slow", "stopped"], (faults, output[-3000:])
    assert "rank 1 attempt 0: SIGKILL after step 3" in output
    assert "(writing in the background)" in output and f"checkpoint {url}/checkpoints/step-00000002: complete" in output
    # Rank 1 died after step 3's update, with step 2's checkpoint still in flight (complete at the
    # earliest two steps after its save): step 1's, the latest complete one, is where attempt 1 starts.
    assert resumed_from(output) == ["step-00000001"], output[-3000:]
    assert rc != 0, "the job ended normally with its store stopped"
    errors = [line for line in output.splitlines() if "error: " in line and url in line]
    assert errors and "failed" in errors[0], output[-3000:]
    complete = sorted({k.split("/")[2] for k in store.keys(bucket, "run/checkpoints/") if k.endswith("/commit.json")})
    assert complete and complete[-1] >= "step-00000005", complete

    rc, output = job("torchrun", args, tmp_path / "again", data, url=url)
    assert rc == 0, output[-4000:]
    assert resumed_from(output) == [complete[-1]], output[-3000:]
    local = tmp_path / "fetched"
    local.mkdir()
    for name in ("last.pth", "history.csv", "metrics.json", "best.pth", "training_results.png"):
        client.download_file(bucket, f"run/{name}", str(local / name))
    assert_bitwise(local, reference)
    kept = sorted({k.split("/")[2] for k in store.keys(bucket, "run/checkpoints/") if k.endswith("/commit.json")})
    # Kept 2 complete ones; the older complete ones pruned (what the stopped store left half-removed or
    # half-written is never complete, and retention removes only complete ones).
    assert kept == ["step-00000007", "step-00000008"], kept
