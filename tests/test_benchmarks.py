"""The benchmark suite end to end, at its smallest setting: every backend
through parallelx and through its plain script, under the real launchers.

    python -m pytest tests/test_benchmarks.py

Only that it runs and what it checks are asserted (results for every
backend, parallelx's final weights equal to the plain scripts'); never
timings, which mean nothing on a shared CI machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from launching import BIN, ROOT, require_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(420)]

RUN_TIMEOUT_S = 360
FAMILIES = ("ddp", "horovod", "deepspeed")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    for launcher in ("torchrun", "horovodrun", "deepspeed"):
        require_launcher(launcher)
    if not (BIN / "accelerate").exists():
        if os.environ.get("CI"):
            pytest.fail("accelerate is not installed; run scripts/setup.sh")
        pytest.skip("accelerate is not installed")
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "benchmarks.run", "--mode", "smoke", "--control", "--out-dir", str(out / "results"),
           "--work-dir", str(out / "work")]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the orchestrator then kills the launch it is running.
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"benchmarks.run --mode smoke ran past {RUN_TIMEOUT_S}s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"benchmarks.run --mode smoke exited {proc.returncode}:\n{output[-6000:]}"
    return out / "results", json.loads((out / "results" / "results.json").read_text())


def test_writes_json_markdown_and_chart(smoke):
    results_dir, result = smoke
    assert (results_dir / "results.md").read_text().startswith("# Benchmark results")
    assert (results_dir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["failures"] == []
    assert result["meta"]["machine"]["threads_n"] >= 1


def test_each_process_is_pinned_to_its_own_cores(smoke):
    _, result = smoke
    machine = result["meta"]["machine"]
    assert machine["bind_cores"] == (machine["gpus"] == 0 and hasattr(os, "sched_setaffinity"))
    if not machine["bind_cores"]:
        pytest.skip("processes are pinned only on the CPU (Linux)")
    pinned = [r for r in result["runs"] if r["nproc"] * r["threads"] <= machine["cores"]]
    assert pinned, "no run fits the cores"
    for r in pinned:
        per_rank = r["cores"]
        assert [len(c) for c in per_rank] == [r["threads"]] * r["nproc"], f"{r['impl']} {r['case_id']}: {per_rank}"
        flat = [core for cores in per_rank for core in cores]
        assert len(set(flat)) == len(flat), f"{r['impl']} {r['case_id']}: ranks share a core: {per_rank}"


def test_every_backend_has_results_for_both_models(smoke):
    _, result = smoke
    nproc = result["meta"]["machine"]["nproc"]
    for impl in [f"{kind}-{f}" for f in FAMILIES for kind in ("raw", "px")] + ["accelerate"]:
        for model in ("lenet", "vgg16"):
            rows = [r for r in result["runs"] if r["impl"] == impl and r["model"] == model and r["nproc"] == nproc]
            assert rows, f"no {model} result for {impl}"
            for r in rows:
                assert r["images_per_s"] > 0 and r["median_step_s"] > 0 and r["peak_rss_mib"] > 0


def test_parallelx_final_weights_equal_the_plain_scripts(smoke):
    _, result = smoke
    nproc = result["meta"]["machine"]["nproc"]
    compared = {(w["impl"], w["case_id"]) for w in result["weights"] if w["nproc"] == nproc}
    for family in FAMILIES:
        assert any(impl == f"px-{family}" for impl, _ in compared), f"px-{family} weights were not compared"
    for w in result["weights"]:
        assert w["passed"], f"{w['impl']} vs {w['baseline']} on {w['case_id']}: max |diff| {w['max_abs_diff']}"


def test_control_runs_of_the_plain_scripts_repeat_them_exactly(smoke):
    # The same plain script twice: the ratio's noise floor, and a check that
    # the workload itself is deterministic (else parallelx's equality would mean little).
    _, result = smoke
    nproc = result["meta"]["machine"]["nproc"]
    for family in FAMILIES:
        same = [w for w in result["weights"] if w["impl"] == f"ctl-{family}" and w["nproc"] == nproc]
        assert same and all(w["identical"] for w in same), f"ctl-{family}: {same}"
        assert any(o["impl"] == f"ctl-{family}" and o["baseline"] == f"raw-{family}" for o in result["overhead"])


def test_same_process_runs_give_identical_models(smoke):
    # The plain step and parallelx's alternate in one launch per backend, on
    # the same batches: their models must end bit-for-bit equal.
    _, result = smoke
    by_family = {s["family"]: s for s in result["same_process"]}
    assert set(by_family) == set(FAMILIES)
    for family, s in by_family.items():
        assert s["max_abs_weight_diff"] == 0.0, f"{family}: {s['max_abs_weight_diff']}"
        assert s["ratio"] > 0 and len(s["block_ratios"]) == s["blocks"] >= 2


def test_overhead_scaling_and_loader_are_reported(smoke):
    _, result = smoke
    assert {o["impl"] for o in result["overhead"]} >= {"px-ddp", "px-horovod", "px-deepspeed", "accelerate"}
    assert all(o["ratio"] > 0 for o in result["overhead"])
    assert {s["impl"] for s in result["scaling"]} >= {"raw-ddp", "px-ddp"}
    loader = result["loader"]
    assert "error" not in loader, loader.get("error")
    assert all(r["images_per_s"] > 0 for r in loader["results"])
    assert loader["model"], "no VGG16 throughput to compare the loader with"
