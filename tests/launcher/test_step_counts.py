"""parallelx's training step adds no collective, no byte on the wire and no host read to the
engine's own step: counted, never timed.

One launch per launcher (``tests/support/step_counts_worker.py``, 2 processes on the CPU): torchrun
runs DDP and FSDP2, the deepspeed launcher ZeRO 0 to 3.  For each, the engine's own loop and
parallelx's documented loop train the same GPT (``benchmarks/engine_steps.py``: nanoGPT's, tied
embedding, AdamW in two groups) in the same processes; after two steps each, one step of each is
counted: every collective of every process group (torch's Flight Recorder: DDP's C++ reducer,
FSDP2's and DeepSpeed's collectives included), its bytes, and every read of a tensor's value by the
host (``.item()``, ``bool(t)``, ``.tolist()``, a copy to the CPU).  The loss sequences must be equal.

What parallelx may add is listed here, each with why (docs/benchmarks.md gives what it costs):

- **the forward lockstep** (fsdp, ZeRO-3: ``parallelx.parts.lockstep``): one all-reduce of 4
  int64 on a Gloo group of its own before each forward and one read of its result; it turns a
  rank-0-only forward of a sharded model into one clear error instead of a hang.
  ``PARALLELX_FORWARD_LOCKSTEP=0`` leaves it out.
- **the gradient norm** ``backend.step`` returns (fsdp, ZeRO 1-3, where each rank holds a share of
  the gradients): one all-reduce of one float64 per parameter (its shard's squared norm), and one
  read of it under ZeRO 1-3 (the partitions' layout).

Anything else fails: a new collective, more bytes than those, more host reads.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
from launching import worker_reports

from benchmarks.engine_steps import Counts, differences

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(420)]

#: launcher -> the engines its one launch compares
LAUNCHES = {"torchrun": ("ddp", "fsdp"), "deepspeed": ("zero0", "zero1", "zero2", "zero3")}
#: The engines whose forwards are collectives (the lockstep runs before each).
LOCKSTEP = {"fsdp", "zero3"}
#: The engines whose gradients are sharded (the reported norm needs an all-reduce).
SHARDED_NORM = {"fsdp", "zero1", "zero2", "zero3"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Callable[[str], list[dict]]:
    """Each launcher's ranks' reports, launched once for all of its engines."""
    done: dict[str, list[dict]] = {}

    def reports(launcher: str) -> list[dict]:
        if launcher not in done:
            cases = {launcher: (launcher, "ddp" if launcher == "torchrun" else "deepspeed", ["--launcher", launcher])}
            done[launcher] = worker_reports(launcher, cases, "step_counts_worker.py", tmp_path_factory, timeout=360)
        return done[launcher]

    return reports


def allowed(engine: str) -> tuple[list[dict[str, Any]], collections.Counter[str]]:
    """The collectives and host reads parallelx adds by design (the module's docstring)."""
    extra: list[dict[str, Any]] = []
    reads: collections.Counter[str] = collections.Counter()
    if engine in LOCKSTEP:
        extra.append({"kind": "all_reduce", "sizes": [[4]], "dtypes": ["Long"]})
        reads["tolist"] += 1
    if engine in SHARDED_NORM:
        extra.append({"kind": "all_reduce", "dtypes": ["Double"]})  # one entry per parameter
        if engine != "fsdp":
            reads["tolist"] += 1
    return extra, reads


def strip_allowed(engine: str, raw: Counts, px: Counts) -> Counts:
    """``px`` without what :func:`allowed` lists (each at most once); what is left must match ``raw``."""
    extra, reads = allowed(engine)
    left = list(px.collectives)
    for want in extra:
        for i, c in enumerate(left):
            if all(c[k] == v for k, v in want.items()):
                if want["dtypes"] == ["Double"]:
                    # The norm's entries: one float64 per parameter (at most as many as 8 bytes each of the model's).
                    assert len(c["sizes"]) == 1 and len(c["sizes"][0]) <= 2, c
                del left[i]
                break
    host = {k: max(0, n - reads.get(k, 0)) for k, n in px.host_reads.items()}
    return Counts(left, {k: n for k, n in host.items() if n})


@pytest.mark.parametrize(("launcher", "engine"), [(k, e) for k, es in LAUNCHES.items() for e in es])
def test_parallelx_adds_no_collective_no_byte_no_host_read_to_the_engines_step(launcher, engine, launched):
    for r in launched(launcher):
        entry = r[engine]
        raw = Counts(entry["raw"]["collectives"], entry["raw"]["host_reads"])
        px = Counts(entry["parallelx"]["collectives"], entry["parallelx"]["host_reads"])
        # The counting sees the engine's own gradient traffic, so an extra one could not hide.
        assert raw.collectives and raw.bytes > 100_000, (engine, raw.as_dict())
        assert entry["parallelx"]["losses"] == entry["raw"]["losses"], (
            engine,
            entry["raw"]["losses"],
            entry["parallelx"]["losses"],
        )
        problems = differences(raw, strip_allowed(engine, raw, px))
        assert not problems, f"{engine}: parallelx's step does more than the engine's: " + "; ".join(problems)


def test_bf16_compute_gathers_half_the_bytes_of_bf16_mixed(launched):
    """fsdp under ``--precision bf16-compute`` all-gathers bfloat16 copies of the weights, where
    ``bf16-mixed`` (autocast over float32 FSDP2) gathers float32: half the all-gather bytes; the
    gradients are reduce-scattered in float32 under both, so those bytes are equal."""
    for r in launched("torchrun"):
        by = {p: Counts(c["collectives"], c["host_reads"]) for p, c in r["precisions"].items()}

        def traffic(counts: Counts, kind: str, dtypes: set[str]) -> int:
            return sum(c["bytes"] for c in counts.collectives if c["kind"] == kind and set(c["dtypes"]) <= dtypes)

        mixed, compute = by["bf16-mixed"], by["bf16-compute"]
        # On Gloo FSDP2's gathers are all_gathers and its reduce-scatters all_reduces (measured at 2
        # processes on the tiny GPT: 2,500,480 bytes gathered in float32, 1,250,240 in bfloat16).
        gathered = traffic(mixed, "all_gather", {"Float"}), traffic(compute, "all_gather", {"BFloat16"})
        reduced = traffic(mixed, "all_reduce", {"Float"}), traffic(compute, "all_reduce", {"Float"})
        assert gathered[0] > 100_000 and gathered[1] == gathered[0] // 2, (gathered, mixed.kinds(), compute.kinds())
        assert reduced[0] == reduced[1] > 0, reduced
