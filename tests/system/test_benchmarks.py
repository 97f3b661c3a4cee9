"""The benchmark suite end to end, at its smallest setting: every backend
through parallelx and through its plain script, under the real launchers.

    python -m pytest tests/system/test_benchmarks.py

Only that it runs and what it checks are asserted (results for every
backend, parallelx's final weights equal to the plain scripts'); never
timings, which mean nothing on a shared CI machine.  The same-process part
is left to ``tests/launcher/test_parity.py``, which runs the same worker.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from launching import run_with_grace

from benchmarks.launch import unavailable

# The benchmarks' own rehearsals (a dozen launches, 5 minutes here): make test-matrix, kept out of CI's
# scenarios for CI's time (docs/testing.md); parallelx against the plain scripts, to the bit, is
# tests/launcher/test_parity.py's, in make test.
pytestmark = [pytest.mark.launcher, pytest.mark.timeout(420)]

RUN_TIMEOUT_S = 360
FAMILIES = ("ddp", "horovod", "deepspeed")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    missing = "; ".join(f"{part}: {why}" for part in FAMILIES if (why := unavailable(part)))
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; run scripts/setup.sh")
        pytest.skip(missing)
    out = tmp_path_factory.mktemp("bench")
    parts = "ddp,horovod,deepspeed,scaling"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--mode",
        "smoke",
        "--control",
        "ddp",
        "--only",
        parts,
        # LeNet only: VGG16 runs the same code on a 138M-parameter model, most of this run's time on 2 cores.
        "--models",
        "lenet",
        "--out-dir",
        str(out / "results"),
        "--raw",
        str(out / "raw.json"),
        "--work-dir",
        str(out / "work"),
    ]
    # 15 s of grace: the orchestrator then kills the launch it is running.
    rc, output = run_with_grace(cmd, timeout=RUN_TIMEOUT_S, grace=15, what="benchmarks.run --mode smoke")
    assert rc == 0, f"benchmarks.run --mode smoke exited {rc}:\n{output[-6000:]}"
    return out / "results", json.loads((out / "raw.json").read_text())


@pytest.mark.matrix
def test_writes_markdown_and_a_compact_summary(smoke):
    results_dir, result = smoke
    assert sorted(p.name for p in results_dir.iterdir()) == ["results.md", "summary.json"]
    assert (results_dir / "results.md").read_text().startswith("# Benchmark results")
    text = (results_dir / "summary.json").read_text()
    assert len(text.splitlines()) < 60, "the summary should stay a few dozen lines; step times go to --raw"
    summary = json.loads(text)
    assert summary["failures"] == [] and result["failures"] == []
    assert summary["env"]["processes"] == result["meta"]["machine"]["nproc"]
    assert {c["impl"] for c in summary["comparisons"]} >= {"px-ddp", "px-horovod", "px-deepspeed"}


@pytest.mark.matrix
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


@pytest.mark.matrix
def test_every_backend_has_results(smoke):
    _, result = smoke
    nproc = result["meta"]["machine"]["nproc"]
    assert {r["model"] for r in result["runs"]} == {"lenet"}, "--models lenet was not followed"
    for impl in [f"{kind}-{f}" for f in FAMILIES for kind in ("raw", "px")]:
        for model in ("lenet",):
            rows = [r for r in result["runs"] if r["impl"] == impl and r["model"] == model and r["nproc"] == nproc]
            assert rows, f"no {model} result for {impl}"
            for r in rows:
                assert r["images_per_s"] > 0 and r["median_step_s"] > 0 and r["peak_rss_mib"] > 0


@pytest.mark.matrix
def test_parallelx_final_weights_equal_the_plain_scripts(smoke):
    _, result = smoke
    nproc = result["meta"]["machine"]["nproc"]
    compared = [c for c in result["comparisons"] if c["max_abs_weight_diff"] is not None]
    for family in FAMILIES:
        assert any(c["impl"] == f"px-{family}" and c["nproc"] == nproc for c in compared), (
            f"px-{family} weights were not compared"
        )
    for c in compared:
        assert c["weights_passed"], f"{c['impl']} vs {c['baseline']} on {c['case_id']}: {c['max_abs_weight_diff']}"


@pytest.mark.matrix
def test_control_runs_of_the_plain_scripts_repeat_them_exactly(smoke):
    # The same plain script twice: the ratio's noise floor, and a check that
    # the workload itself is deterministic (else parallelx's equality would mean little).
    # The smoke run controls ddp's script only (each control is a launch): the others' determinism
    # is what tests/launcher/test_parity.py checks to the bit.
    _, result = smoke
    nproc = result["meta"]["machine"]["nproc"]
    controls = {c["impl"] for c in result["comparisons"] if c["impl"].startswith("ctl-")}
    assert controls == {"ctl-ddp"}, controls
    same = [c for c in result["comparisons"] if c["impl"] == "ctl-ddp" and c["nproc"] == nproc]
    assert same and all(c["baseline"] == "raw-ddp" and c["weights_equal"] for c in same), same


@pytest.mark.matrix
def test_overhead_and_scaling_are_reported(smoke):
    _, result = smoke
    assert all(c["ratio"] > 0 and c["how"] == "launches" for c in result["comparisons"])
    assert {s["impl"] for s in result["scaling"]} >= {"raw-ddp", "px-ddp"}


@pytest.mark.matrix
@pytest.mark.timeout(150)
def test_loop_options_benchmark_runs_the_real_loop(tmp_path):
    # benchmarks.loops at its smallest: the 1-process baseline and 2 DDP
    # processes with accumulation and bf16 gradients, through the loop options.
    if why := unavailable("ddp"):
        pytest.skip(why)
    out, work = tmp_path / "results", tmp_path / "work"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.loops",
        "--smoke",
        "--only",
        "single,ddp-acc4-bf16",
        "--out-dir",
        str(out),
        "--raw",
        str(tmp_path / "raw.json"),
        "--work-dir",
        str(work),
    ]
    rc, output = run_with_grace(cmd, timeout=120, grace=15, what="benchmarks.loops --smoke")
    assert rc == 0, f"benchmarks.loops --smoke exited {rc}:\n{output[-6000:]}"
    assert (out / "results.md").read_text().startswith("# Training-loop options")
    summary = json.loads((out / "summary.json").read_text())
    rows = {t["config"]: t for t in summary["table"]}
    assert set(rows) == {"single", "ddp-acc4-bf16"} and summary["failures"] == []
    assert (rows["single"]["procs"], rows["single"]["micro_batch"]) == (1, 2 * rows["ddp-acc4-bf16"]["micro_batch"])
    assert rows["ddp-acc4-bf16"]["vs_single"]["ratio"] > 0
    reports = [json.loads(p.read_text()) for p in (work / "out").glob("loop-ddp-acc4-bf16-*/*.rank*.json")]
    assert len(reports) == 2
    for rep in reports:
        # The options reached the backend, and the timed micro-batches made whole windows.
        assert rep["options"]["accumulate"] == 4 and rep["options"]["grad_compression"] == "bf16"
        assert len(rep["window_times_s"]) == rep["case"]["steps"] // 4


@pytest.mark.matrix
@pytest.mark.timeout(270)
def test_activation_checkpointing_benchmark_runs_both_settings(tmp_path):
    # benchmarks.activations at its smallest, on ddp (fsdp applies checkpointing through the same
    # wrap_model, and the transformer launches check its weights): launched without and with
    # checkpointing; what is deterministic is asserted, never memory or time.
    if why := unavailable("ddp"):
        pytest.skip(why)
    out = tmp_path / "activations.json"
    cmd = [sys.executable, "-m", "benchmarks.activations", "--tiny", "--backends", "ddp", "--out", str(out)]
    rc, output = run_with_grace(cmd, timeout=240, grace=15, what="benchmarks.activations --tiny")
    assert rc == 0, f"benchmarks.activations --tiny exited {rc}:\n{output[-6000:]}"
    results = {r["backend"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"ddp"}
    for name, r in results.items():
        none, auto = r["none"], r["auto"]
        assert len(none) == len(auto) == 2, name
        # --tiny has 2 blocks; checkpointing keeps only their inputs, not their activations.
        assert all(x["checkpointed_blocks"] == 0 for x in none) and all(x["checkpointed_blocks"] == 2 for x in auto)
        assert max(x["saved_bytes"] for x in auto) < max(x["saved_bytes"] for x in none) / 2, name
        assert r["weights"]["identical"], f"{name}: {r['weights']}"
        assert auto[0]["time_ratio"] > 0


@pytest.mark.matrix  # minutes of peers' launches: make test-matrix (CI's time: docs/testing.md)
@pytest.mark.timeout(900)
def test_peers_benchmark_reports_times_only_for_equal_losses(tmp_path):
    # benchmarks.peers at its smallest: raw PyTorch and parallelx (and Accelerate and Fabric where
    # installed) in ddp and fsdp, parallelx's fsdp learning rate changed by one part in a million.
    # That launch must get no time (its losses differ from raw FSDP2's) and the run exit 1; every
    # other implementation's losses equal raw's to the bit and it gets a ratio.  Timings are not asserted.
    if why := unavailable("ddp"):
        pytest.skip(why)
    from benchmarks import peers

    out = tmp_path / "peers.json"
    cmd = [sys.executable, "-m", "benchmarks.peers", "--quick", "--perturb", "parallelx:fsdp", "--out", str(out)]
    cmd += ["--timeout", "240"]
    # 8 launches: about 3 minutes on 2 cores, 9 at a load of 18.
    rc, output = run_with_grace(cmd, timeout=840, grace=15, what="benchmarks.peers --quick")
    assert rc == 1, f"benchmarks.peers --quick --perturb parallelx:fsdp exited {rc}, not 1:\n{output[-6000:]}"
    assert "LOSSES DIFFER: parallelx fsdp" in output and "no time reported" in output
    rows = {(r["impl"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    perturbed = rows.pop(("parallelx", "fsdp"))
    # Step 0's loss comes before any update; the first update's change may round away in the next.
    assert not perturbed["losses"]["passed"] and perturbed["losses"]["first_step"] >= 1, perturbed["losses"]
    assert "ratio" not in perturbed and "median_step_s" not in perturbed
    for peer in ("accelerate", "fabric"):
        if peers.peer_missing(peer):
            assert (peer, "ddp") not in rows or "skipped" in rows[peer, "ddp"]
            for mode in ("ddp", "fsdp"):
                rows.pop((peer, mode), None)
    # Accelerate keeps its FSDP plugin for GPUs: on the CPU the table says so instead of a time.
    if acc := rows.pop(("accelerate", "fsdp"), None):
        assert acc["cannot"] and "ignores its FSDP plugin on the CPU" in acc["error"], acc
    assert {("raw", "ddp"), ("parallelx", "ddp"), ("raw", "fsdp")} <= set(rows)
    for (impl, mode), r in rows.items():
        assert r["losses"]["identical"], f"{impl} {mode}: {r['losses']}"
        assert r["losses_first_last"][1] < r["losses_first_last"][0], f"{impl} {mode} did not train"
        assert r["median_step_s"] > 0 and r["startup_s"] > 0 and all(m > 0 for m in r["peak_rss_mib"])
        assert ("ratio" in r) == (impl != "raw"), f"{impl} {mode}"
        # The same sharding everywhere: each of the --quick GPT's 2 blocks, then the root.
        assert r["sharded_units"] == (3 if mode == "fsdp" else 0), f"{impl} {mode}"
        # Only parallelx's own processes import parallelx: the others' start-up times are their own.
        assert r["imported_parallelx"] == (impl == "parallelx"), f"{impl} {mode}"
