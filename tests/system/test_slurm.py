"""The recipes under a real one-machine Slurm (munged, slurmctld and slurmd
started by the fixture, see tests/support/slurm_cluster.py): srun's tasks as
the ranks, with no other launcher, and one task running torchrun from a batch
script.  Every run must end with the torchrun reference's weights, bit for bit.

Skipped, with the reason, where the daemons cannot run (not root, Slurm or
munge not installed: scripts/setup.sh installs them as root)."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from engines import ARGS, assert_bitwise, assert_exact_metrics, job_env, rel_err, resumed_from, run, weights
from launching import ROOT, latest_step, wait_for
from slurm_cluster import SlurmCluster, unavailable
from verdicts import WORKER, lines, one_verdict

from parallelx.launching.launchers import free_port

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no test Slurm: {reason}")
    start = time.monotonic()
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    print(f"test Slurm started in {time.monotonic() - start:.1f}s")
    yield cluster
    cluster.stop()


def srun(
    slurm: SlurmCluster,
    args: list[str],
    out: Path,
    data: Path,
    *,
    name: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 150,
    while_running=None,
) -> tuple[int, str]:
    """``srun -n 2`` of the CIFAR-10 recipe (``args`` start with the script)."""
    cmd = [
        "srun",
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        f"--job-name={name or 'px-' + uuid.uuid4().hex[:8]}",
        "python",
        *args,
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        *ARGS,
    ]
    return run(
        cmd,
        slurm.env(job_env(**(env or {}))),
        out.parent / f"{out.name}-{time.monotonic_ns()}.log",
        timeout=timeout,
        while_running=while_running,
    )


def test_srun_tasks_preempted_by_scancel_save_exit_0_and_resume_under_auto_bitwise(
    slurm, engine_data, engine_reference, tmp_path
):
    """srun -n 2, --backend ddp, stopped by ``scancel --signal=TERM`` after its first
    checkpoint: every task saves at its next step, and the step exits 0.  Run again
    with ``--backend auto --resume auto``: ddp with 2 ranks, resumed from that
    checkpoint, last.pth and history.csv those of the uninterrupted torchrun run."""
    out, name = tmp_path / "out", f"px-{uuid.uuid4().hex[:8]}"

    def preempt(proc: subprocess.Popen) -> None:
        wait_for(lambda: latest_step(out) >= 1, proc, "the first checkpoint", timeout=100)
        subprocess.run(["scancel", "--signal=TERM", f"--name={name}"], env=slurm.env(), check=True)

    rc, output = srun(
        slurm,
        ["tests/support/resume_wrapper.py", "--backend", "ddp", "--checkpoint-every", "1", "--resume", "auto"],
        out,
        engine_data,
        name=name,
        env={"PXT_DELAY": "0.4"},
        while_running=preempt,
    )
    assert rc == 0, output[-4000:]
    assert "preempted (SIGTERM): checkpoint written" in output, output[-3000:]
    assert not (out / "last.pth").exists(), "stopped before the end"
    saved = latest_step(out)
    assert 1 <= saved < 4

    rc, output = srun(slurm, ["-m", "recipes.cifar10", "--backend", "auto", "--resume", "auto"], out, engine_data)
    assert rc == 0, output[-4000:]
    assert [Path(p).name for p in resumed_from(output)] == [f"step-{saved:08d}"], output[-3000:]
    assert_exact_metrics(out, engine_data, "ddp", 2)
    assert_bitwise(out, engine_reference)


@pytest.mark.parametrize(
    "backend,extra", [("deepspeed", ["--zero-stage", "1"]), ("fsdp", [])], ids=["deepspeed-zero1", "fsdp"]
)
def test_srun_tasks_run_each_backend_that_fits_to_the_torchrun_weights(
    slurm, engine_data, engine_reference, tmp_path, backend, extra
):
    """Measured: both give ddp's weights to the bit (the same averaging, in the same order, on 2 ranks)."""
    out = tmp_path / "out"
    rc, output = srun(slurm, ["recipes/cifar10.py", "--backend", backend, *extra], out, engine_data)
    assert rc == 0, output[-4000:]
    assert_exact_metrics(out, engine_data, backend, 2)
    err = rel_err(weights(out), weights(engine_reference))
    print(f"{backend} {' '.join(extra)} under srun vs ddp under torchrun: relative error {err:.3g}")
    assert err == 0.0, f"{backend} under srun: relative error {err:.3g} from ddp's weights"


PROBE = """
import parallelx
from parallelx.launching.envreport import cluster_lines
from parallelx.errors import LaunchError
print(*cluster_lines(parallelx.detect_backend()), sep="\\n")
try:
    parallelx.get_backend("horovod").init()
except LaunchError as exc:
    print("horovod:", exc)
"""


def test_srun_tasks_are_named_by_the_env_report_and_horovod_says_how_to_launch(slurm):
    rc, output = run(
        ["srun", "-n", "2", "--kill-on-bad-exit=1", "python", "-c", PROBE],
        slurm.env(job_env()),
        Path(slurm.root) / f"probe-{time.monotonic_ns()}.log",
        timeout=60,
    )
    assert rc == 0, output[-3000:]
    lines = output.splitlines()
    for rank in (0, 1):
        assert any(
            ln.startswith("cluster environment: slurm (SLURM_PROCID=") and "--backend auto picks ddp" in ln
            for ln in lines
        ), output
        assert any(
            f"this process: rank {rank} of 2, local rank {rank} of 2, rendezvous localhost:" in ln for ln in lines
        ), output
    refusals = [ln for ln in lines if ln.startswith("horovod: ")]
    assert len(refusals) == 2 and all("horovodrun -np N" in ln and "localhost:2" in ln for ln in refusals), output


def test_a_batch_script_running_torchrun_trains_the_reference_weights(slurm, engine_data, engine_reference, tmp_path):
    """examples/slurm/torchrun.sbatch through ``sbatch --wait``: one task on the node runs torchrun."""
    out, log = tmp_path / "out", tmp_path / "job.out"
    args = [
        "--nodes=1",
        "--cpus-per-task=2",
        f"--output={log}",
        f"--chdir={ROOT}",
        "examples/slurm/torchrun.sbatch",
        "-m",
        "recipes.cifar10",
        "--backend",
        "ddp",
        "--data-dir",
        str(engine_data),
        "--out-dir",
        str(out),
        *ARGS,
    ]
    state, rc = slurm.batch(args, slurm.env(job_env(NPROC_PER_NODE="2", MASTER_PORT=str(free_port()))), timeout=150)
    job_output = log.read_text(errors="replace") if log.exists() else ""
    assert (state, rc) == ("COMPLETED", 0), job_output[-4000:]
    assert_exact_metrics(out, engine_data, "ddp", 2)
    assert_bitwise(out, engine_reference)


@pytest.mark.parametrize(("backend", "part"), [("ddp", "branch"), ("deepspeed", "eval")])
def test_ranks_that_part_ways_under_srun_print_one_verdict_naming_the_rank_and_the_line(slurm, tmp_path, backend, part):
    """srun's tasks as the ranks (no other launcher; the store is the one parallelx serves from
    SLURM_* variables): a collective on rank 0 only under ddp, an evaluation on rank 0 only under
    ZeRO-3; both tasks print the same verdict with the script's line (tests/launcher/test_hangs.py
    runs the same worker under the other launchers)."""
    extra = ["--zero-stage", "3"] if backend == "deepspeed" else []
    cmd = ["srun", "-n", "2", "--kill-on-bad-exit=1", "python", str(WORKER), "--backend", backend, *extra]
    # DeepSpeed's first rank loads its communication op while the other waits in the rendezvous, whose
    # wait is this timeout too: 10 s ran out there on a loaded machine (CI), before the part under test.
    timeout = "20" if backend == "deepspeed" else "10"
    cmd += ["--timeout", timeout, "--out", str(tmp_path), "--part", part]
    rc, output = run(cmd, slurm.env(job_env()), tmp_path / "job.log", timeout=200)
    assert rc != 0, output[-3000:]
    text = one_verdict(output)
    assert any(line in text for line in lines(part)), text
    assert "rank 0 ran code the others did not" in text, text
    print(f"{backend} {part} under srun: {text[:200]}")
