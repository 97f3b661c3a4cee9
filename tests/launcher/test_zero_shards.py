"""ZeRO 1-3's sharded training-state checkpoints (``--zero-sharded-checkpoints``) under the real
launchers: each rank writes only its own partitions, of the weights and of the optimizer state, as
``torch.distributed.checkpoint`` shards at the tensors' own shapes; nothing is gathered.

- Under the deepspeed launcher at 2 processes, ZeRO 1, 2 and 3 in one launch (1 and 3 saving
  asynchronously, their shards written by the background writer only after the training's next
  steps, so what was loaded equal to what was saved shows the copies were written): the checkpoint's index
  lists every tensor at its shape, cut among the ranks (no rank's run is a whole tensor but where a
  partition boundary falls on one), ``state.pt`` holds no tensor of the model or the optimizer, and a
  fresh run loads exactly what was saved and continues to the uninterrupted run's bits.
- Across engines and world sizes: ZeRO-3's checkpoint at 2 -> fsdp at 4 (torchrun, its own slices
  read), which trains on and saves its own -> ddp at a world of one (this process, the whole tensors): each
  load is exactly the state that was saved, bit for bit.  (Across world sizes the steps after a load
  differ by design: a step takes each rank's batch.  The same world size continues bitwise, above;
  across backends at one world size, tests/launcher/test_trainstate_launch.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launching import launch, require_launcher
from trainstate_worker import MORE, Run, max_diff

import parallelx
from parallelx import storage

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(900)]
STAGES = (1, 2, 3)
ASYNC = (1, 3)  # these stages' saves are asynchronous (--checkpoint-async), written while the training goes on
_runs: dict[str, Path] = {}


def zero_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "zero" not in _runs:
        require_launcher("deepspeed")
        out = tmp_path_factory.mktemp("zero-shards")
        res = launch(
            "deepspeed",
            ["tests/support/zero_shards_worker.py", "--backend", "deepspeed", "--zero-sharded-checkpoints"]
            + ["--out", str(out), "--stages", *map(str, STAGES), "--async-stages", *map(str, ASYNC)],
            timeout=600,
        )
        assert res.returncode == 0, res.tail(80)
        _runs["zero"] = out
    return _runs["zero"]


def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "fsdp" not in _runs:
        require_launcher("torchrun")
        source = zero_run(tmp_path_factory) / "zero3" / "run" / "checkpoints" / "step-00000003"
        out = tmp_path_factory.mktemp("fsdp-from-zero3")
        res = launch(
            "torchrun",
            ["tests/support/zero_shards_worker.py", "--backend", "fsdp", "--fsdp-sharded-checkpoints"]
            + ["--load", str(source), "--out", str(out)],
            nproc=4,
            timeout=400,
        )
        assert res.returncode == 0, res.tail(80)
        _runs["fsdp"] = out
    return _runs["fsdp"]


@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_writes_its_partitions_and_a_resume_continues_bitwise(stage, tmp_path_factory):
    out = zero_run(tmp_path_factory) / f"zero{stage}"
    r = torch.load(out / "result.pt", weights_only=True)
    assert r["world_size"] == 2 and r["sharded"] is True
    if stage in ASYNC:  # the shards were written by the writer thread, after A's later steps
        assert r["writer_threads"] == ["parallelx-checkpoint"], r["writer_threads"]
    assert max_diff(r["loaded"]["model"], r["saved"]["model"]) == 0.0
    assert max_diff(r["loaded"]["optimizer"], r["saved"]["optimizer"]) == 0.0
    assert max_diff(r["A"], r["B"]) == 0.0, "the resumed run is not the uninterrupted one"
    ckpt = out / "run" / "checkpoints" / "step-00000003"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    assert state["model"] is None and state["optimizer"]["state"] == {}, "state.pt holds tensors"
    assert state["optimizer"]["engine_counters"]["global_steps"] == 3
    index = storage.dcp_reader(ckpt / "shards").read_metadata()
    files = {i.relative_path for i in index.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    for name, value in r["saved"]["model"].items():
        meta = index.state_dict_metadata[f"model.{name}"]
        assert tuple(meta.size) == tuple(value.shape), name
        assert sum(c.sizes.numel() for c in meta.chunks) == value.numel(), name  # every element once
        for key in ("exp_avg", "exp_avg_sq"):
            assert tuple(index.state_dict_metadata[f"optimizer.state.{name}.{key}"].size) == tuple(value.shape)
    # Neither rank's file holds the whole model: the chunks each rank wrote, in elements.
    written = [0, 0]
    for idx, info in index.storage_data.items():
        if idx.fqn.startswith("model.") and idx.offset is not None:
            meta = index.state_dict_metadata[idx.fqn]
            chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(idx.offset))
            written[int(info.relative_path[2])] += chunk.sizes.numel()
    total = sum(v.numel() for v in r["saved"]["model"].values())
    assert sum(written) == total and max(written) < total, (written, total)


@pytest.mark.scenario  # a 4-process launch of its own; make test runs the stages' launch above
def test_zero3_at_two_then_fsdp_at_four_then_ddp_at_one(tmp_path_factory, monkeypatch):
    zero = torch.load(zero_run(tmp_path_factory) / "zero3" / "result.pt", weights_only=True)
    fsdp = torch.load(fsdp_run(tmp_path_factory) / "result.pt", weights_only=True)
    assert fsdp["world_size"] == 4 and fsdp["counters"]["global_step"] == 3
    # fsdp at 4 read exactly what ZeRO-3 at 2 saved, each rank its own rows.  (It goes on with twice the
    # global batch, 4 ranks' batches a step: its weights are its own from there, not ZeRO-3's.)
    assert max_diff(fsdp["loaded"]["model"], zero["saved"]["model"]) == 0.0
    assert max_diff(fsdp["loaded"]["optimizer"], zero["saved"]["optimizer"]) == 0.0
    assert max_diff(fsdp["B"], fsdp["saved_B"]["model"]) == 0.0 and max_diff(fsdp["B"], zero["A"]) > 0
    # ddp at a world of one (in this process) reads fsdp's sharded checkpoint whole.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # the world of one sets them
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    with parallelx.get_backend("ddp") as single:
        c = Run(single, "adamw", init_seed=5, dropout=0.0, noise=False)
        info = c.load(Path(fsdp["path_B"]))
        assert info["meta"]["backend"] == "fsdp" and info["meta"]["world_size"] == 4
        loaded = single.named_optimizer_state(c.model, c.optimizer)["state"]
        assert max_diff(c.weights(), fsdp["saved_B"]["model"]) == 0.0
        assert max_diff(loaded, fsdp["saved_B"]["optimizer"]) == 0.0
        c.train(MORE)
        assert c.counters["global_step"] == 3 + 2 * MORE
