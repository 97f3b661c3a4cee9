"""``python -m parallelx estimate`` against ``benchmarks.memory``'s measurement: a 19 M-parameter
GPT (``benchmarks.memory:gpt_20m``, 73 MiB of float32 weights) with AdamW, ddp, fsdp and ZeRO-3 at 2
processes under their own launchers (one launch each, 2-7 minutes in all on 2 shared cores).

- The tensors each rank holds (its parameters, gradients and AdamW state: a DTensor's shard, a
  ZeRO-3 partition) equal the estimate's figures within 1 % (the shards' padding).
- The peak RSS growth through set-up and after one step, less what the build grew beyond the
  model's own tensors (code and allocator pages the first build touches, about 150 MiB here
  whatever the model: read off each rank's own build), lies between the estimate minus 10 % and
  the estimate plus 25 %, plus 64 MiB through set-up and 128 MiB after the step.  The estimate leaves out what does not
  scale with the model: the first forward, backward and step of a process touch code and
  allocator pages too (about 100 MiB measured on the CPU), the activations of the batch (2 x 64
  tokens), and allocator slack.  At 202 M parameters the same gaps measured 4-16 %
  (docs/big-models.md).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from launching import run_with_grace

from benchmarks.launch import unavailable

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(1200)]

MiB = 2**20
#: What the estimate leaves out of the step that does not scale with the model (see the docstring).
FIXED_STEP = 128 * MiB
#: And of the set-up: what a process touches beyond the tensors while a backend sets up (ddp, fsdp and
#: ZeRO-3, whose engine waits for the first forward, measured within 3 MiB of their estimates here;
#: DeepSpeed's engine, when it was built at set-up, 23-55 MiB).
FIXED_SETUP = 64 * MiB
OVER, UNDER = 0.25, 0.10


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    missing = "; ".join(f"{part}: {why}" for part in ("ddp", "deepspeed") if (why := unavailable(part)))
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; run scripts/setup.sh")
        pytest.skip(missing)
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    cmd = [sys.executable, "-m", "benchmarks.memory", "--model", "gpt-20m", "--nproc", "2"]
    cmd += ["--cases", "ddp", "fsdp", "zero3", "--launch-timeout", "420", "--out", str(out)]
    rc, output = run_with_grace(cmd, timeout=1100, grace=15, what="benchmarks.memory --model gpt-20m")
    assert rc == 0, f"benchmarks.memory exited {rc}:\n{output[-6000:]}"
    return json.loads(out.read_text()), output


@pytest.mark.parametrize("case", ["ddp", "fsdp", "zero3"])
def test_each_ranks_tensors_are_the_estimates(measured, case):
    found, _ = measured
    guess = found["estimates"][case]["2"]
    rows = found["results"][case]["2"]
    assert len(rows) == 2
    # ZeRO-3 keeps its gradient partitions in a flat buffer of its own, not in param.grad.
    fields = ("params", "optimizer") if case == "zero3" else ("params", "grads", "optimizer")
    for row in rows:
        for field in fields:
            assert abs(row[field] - guess[field]) <= 0.01 * guess[field] + 4096, (case, field, row[field], guess)


@pytest.mark.parametrize("case", ["ddp", "fsdp", "zero3"])
def test_the_peak_is_the_estimates_within_the_margin(measured, case):
    found, output = measured
    guess = found["estimates"][case]["2"]
    whole = found["estimates"]["ddp"]["2"]
    model = whole["params"] + whole["buffers"]  # ddp keeps the whole model on every rank
    for row in found["results"][case]["2"]:
        build = row["phases"]["build"]
        # The build's growth beyond the model's tensors, every model's (code, allocator pages).
        overhead = max(0, build - model)
        assert overhead < 256 * MiB, f"{case}: building grew the RSS by {build / MiB:.0f} MiB for {model / MiB:.0f}"
        for phase, expected, fixed in (("setup", guess["setup"], FIXED_SETUP), ("step", guess["peak"], FIXED_STEP)):
            got = row["phases"][phase] - overhead
            low, high = (1 - UNDER) * expected, (1 + OVER) * expected + fixed
            assert low <= got <= high, (
                f"{case} {phase}: measured {got / MiB:.0f} MiB beyond the build's own {overhead / MiB:.0f}, "
                f"estimated {expected / MiB:.0f} MiB (allowed {low / MiB:.0f}-{high / MiB:.0f})\n{output[-3000:]}"
            )
