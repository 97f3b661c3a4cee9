"""Safetensors written by parallelx.bigmodels (one process): the layout Hugging Face and safetensors
read, sharding by size with its index, and ``convert-checkpoint --to safetensors`` of a training-state
checkpoint, sharded (torch.distributed.checkpoint, read one tensor at a time) and whole."""

from __future__ import annotations

import json

import pytest
import torch

from parallelx.__main__ import main
from parallelx.bigmodels.export import Layout, Piece, TensorInfo, parse_size, plan_files, write_safetensors
from parallelx.errors import ParallelxError


def test_pieces_written_at_their_offsets_read_back_by_safetensors(tmp_path):
    from safetensors.torch import load_file

    a, b = torch.arange(12.0).view(4, 3), torch.arange(5, dtype=torch.int64)
    tensors = [TensorInfo("a", (4, 3), torch.float32), TensorInfo("b", (5,), torch.int64)]
    # Two "ranks'" runs of a (rows 0-1 and 2-3) and b whole, written out of order.
    pieces = [Piece("a", 6, a[2:].reshape(-1)), Piece("b", 0, b), Piece("a", 0, a[:2].reshape(-1))]
    files = write_safetensors(Layout(tensors, pieces), tmp_path, rank=0, barrier=lambda: None)
    back = load_file(str(files[0]))
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b)
    files = write_safetensors(Layout(tensors, pieces), tmp_path / "s", rank=0, barrier=lambda: None, max_shard_size=50)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": files[0].name, "b": files[1].name}
    assert index["metadata"]["total_size"] == 48 + 40


def test_sizes_and_the_split():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("10KiB") == 10240 and parse_size(7) == 7
    with pytest.raises(ParallelxError, match="max_shard_size"):
        parse_size("lots")
    ts = [TensorInfo(n, (10,), torch.float32) for n in "abc"]  # 40 bytes each
    assert [[t.name for t in f] for f in plan_files(ts, 80)] == [["a", "b"], ["c"]]
    assert len(plan_files(ts, None)) == 1


@pytest.mark.parametrize("shard", [True, False])
def test_convert_checkpoint_to_safetensors_loads_with_from_pretrained(tmp_path, shard):
    import torch.distributed.checkpoint as dcp
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    ckpt = tmp_path / "step-00000001"
    ckpt.mkdir()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if shard:  # as parallelx.save_training_state writes a sharded one (here from one process)
        dcp.save({"model": state, "optimizer": {"state": {}}}, checkpoint_id=str(ckpt / "shards"), no_dist=True)
        torch.save(
            {"model": {}, "optimizer": {"state": {}, "param_groups": []}, "meta": {"sharded": True}}, ckpt / "state.pt"
        )
    else:
        torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}, "meta": {}}, ckpt / "state.pt")
    out = tmp_path / "hf"
    assert main(["convert-checkpoint", str(ckpt), str(out), "--to", "safetensors", "--max-shard-size", "20KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    cfg.save_pretrained(str(out))
    loaded = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


@pytest.mark.parametrize("layout", ["model-only", "fsdp2-example"])
def test_a_plain_dcp_folder_loads_as_pretrained_weights_eager_and_meta(tmp_path, layout):
    # torchtitan's model-only checkpoints (the model's own names) and PyTorch's FSDP2 example's
    # {"model": ..., "optim": ...}, written by plain torch.distributed.checkpoint code.
    import warnings

    import torch.distributed.checkpoint as dcp

    import parallelx
    from parallelx.bigmodels.meta import materialize

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))

    torch.manual_seed(1)
    source = build()
    state = source.state_dict()
    if layout == "fsdp2-example":
        opt = torch.optim.AdamW(source.parameters())
        source(torch.arange(4)).sum().backward()
        opt.step()
        state = {"model": source.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.manual_seed(2)
    eager = build()
    weights = parallelx.load_pretrained(eager, tmp_path / "dcp")
    with parallelx.init_module():
        lazy = build()
    parallelx.load_pretrained(lazy, tmp_path / "dcp")
    materialize(lazy)
    for model in (eager, lazy):
        got = model.state_dict()
        assert sorted(got) == sorted(source.state_dict())
        assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())
    assert weights.bytes_read == sum(v.numel() * v.element_size() for v in source.state_dict().values())
