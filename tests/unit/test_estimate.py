"""``python -m parallelx estimate``: the model counted on the meta device, each backend's rows from
its strategy, clear errors for a bad model path.  Against a measurement: tests/system/test_memory_estimate.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from parallelx.__main__ import main
from parallelx.backends import _deepspeed_config as ds_config
from parallelx.backends.ddp import DDPStrategy
from parallelx.backends.deepspeed import DeepSpeedStrategy
from parallelx.backends.fsdp import FSDPStrategy
from parallelx.bigmodels import estimate
from parallelx.errors import ParallelxError
from parallelx.registry import available_backends, backend_class

MiB = 2**20


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(32), persistent=False)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.fc(self.norm(x)))


class Tied(nn.Module):
    """Embedding and output layer share one weight; two repeated blocks; a non-persistent buffer; a frozen part."""

    def __init__(self, vocab: int = 100, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.rotary = Rotary()
        self.frozen = nn.Linear(width, width, dtype=torch.float64)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def tied() -> nn.Module:
    return Tied()


def test_counts_each_tensor_once_by_dtype_on_meta():
    with torch.device("meta"):
        model = Tied()
    c = estimate.count_model(model)
    width, vocab = 16, 100
    block = (width * 4 * width + 4 * width) + (4 * width * width + width) + 2 * width
    f32 = vocab * width + 2 * block  # the tied weight once
    f64 = width * width + width
    assert c.numel_by_dtype == {"float32": f32, "float64": f64}
    assert c.param_bytes == 4 * f32 + 8 * f64
    assert (c.trainable_numel, c.trainable_bytes) == (f32, 4 * f32)
    assert c.buffer_bytes == 32 * 4  # non-persistent buffers count: they are allocated
    assert c.largest_tensor_numel == vocab * width
    assert c.units == 2 and c.largest_unit_numel == block and c.largest_unit_bytes == 4 * block
    assert c.root_bytes == c.param_bytes - 2 * 4 * block
    assert all(p.device.type == "meta" for p in model.parameters())


def test_layout_shards_what_it_names_and_rounds_up():
    with torch.device("meta"):
        c = estimate.count_model(Tied())
    t = estimate.Training(optimizer="adamw")
    whole = estimate.layout("x", c, 3, t)
    split = estimate.layout("x", c, 3, t, shards=("params", "grads", "optimizer"))
    assert (whole.params, whole.grads, whole.optimizer) == (c.param_bytes, c.trainable_bytes, 2 * c.trainable_bytes)
    assert split.params == -(-c.param_bytes // 3) and split.grads == -(-c.trainable_bytes // 3)
    assert split.optimizer == -(-2 * c.trainable_bytes // 3)
    assert estimate.layout("x", c, 3, estimate.Training(optimizer="sgd")).optimizer == 0
    assert estimate.layout("x", c, 3, estimate.Training(optimizer="adamw-amsgrad")).optimizer == 3 * c.trainable_bytes
    meta = estimate.layout("x", c, 3, estimate.Training(build="meta"), shards=("params",))
    assert meta.setup == split.params + c.buffer_bytes + c.largest_tensor_bytes < split.setup
    with pytest.raises(ParallelxError, match="unknown shards"):
        estimate.layout("x", c, 2, t, shards=("weights",))
    with pytest.raises(ParallelxError, match="unknown optimizer 'lion'"):
        estimate.Training(optimizer="lion")


def test_each_backend_gives_its_rows_from_its_strategy():
    with torch.device("meta"):
        c = estimate.count_model(Tied(vocab=1000, width=2048))  # more than one bucket holds
    t = estimate.Training()
    (ddp,) = DDPStrategy.estimate_memory(c, 4, t)
    assert ddp.extra == c.trainable_bytes and ddp.params == c.param_bytes  # DDP's buckets
    (fsdp,) = FSDPStrategy.estimate_memory(c, 4, t)
    assert fsdp.steady < ddp.steady / 3
    zero = {r.backend: r for r in DeepSpeedStrategy.estimate_memory(c, 4, t)}
    assert list(zero) == [f"deepspeed zero{s}" for s in range(4)]
    assert zero["deepspeed zero3"].steady < zero["deepspeed zero2"].steady < zero["deepspeed zero1"].steady
    # Under 16-mixed DeepSpeed's float16 engine halves the weights and keeps float32 masters.
    half = {r.backend: r for r in DeepSpeedStrategy.estimate_memory(c, 4, estimate.Training(precision="16-mixed"))}
    assert (
        half["deepspeed zero0"].params == c.param_bytes // 2 and half["deepspeed zero0"].extra == 4 * c.trainable_numel
    )
    # A backend without an estimate of its own: everything whole on every rank.
    for name in available_backends():
        if name != "auto":
            assert backend_class(name).estimate_memory(c, 2, t), name


def test_zero3_set_up_holds_the_partitions_and_the_engine_waits_for_the_first_forward():
    """From the meta device set-up holds this rank's partitions and one tensor computed whole; the
    engine (the gradients' flat partition, the reduce bucket) is built at the first forward and
    AdamW's state at the first step, both in the peak.  Float32 weights are their own masters;
    under 16-mixed a float32 partition is added."""
    with torch.device("meta"):
        c = estimate.count_model(Tied(vocab=1000, width=2048))  # more than one bucket holds
    t = estimate.Training(build="meta")
    zero3 = {r.backend: r for r in DeepSpeedStrategy.estimate_memory(c, 2, t)}["deepspeed zero3"]
    share = estimate.shard(c.trainable_bytes, 2)
    assert zero3.params == estimate.shard(c.param_bytes, 2) and zero3.grads == share and zero3.extra < share
    assert zero3.setup == zero3.params + c.buffer_bytes + c.largest_tensor_bytes, zero3
    assert zero3.optimizer == 2 * share and zero3.peak >= zero3.params + zero3.grads + zero3.optimizer
    eager = {r.backend: r for r in DeepSpeedStrategy.estimate_memory(c, 2, estimate.Training())}["deepspeed zero3"]
    assert eager.setup == c.state_bytes  # whole until the engine partitions it
    half = {r.backend: r for r in DeepSpeedStrategy.estimate_memory(c, 2, estimate.Training(precision="16-mixed"))}
    masters = estimate.shard(4 * c.trainable_numel, 2)  # a float32 partition beside the 16-bit one
    assert half["deepspeed zero3"].extra > masters > zero3.extra


def test_zero_sizes_follow_the_model_and_the_users_config_wins():
    sizes = ds_config.zero_sizes({}, largest_unit=12_000_000, largest_tensor=3_000_000)
    assert sizes["reduce_bucket_size"] == sizes["stage3_prefetch_bucket_size"] == 12_000_000
    assert sizes["stage3_max_live_parameters"] == 24_000_000
    assert (
        sizes["stage3_param_persistence_threshold"] == ds_config.DEEPSPEED_SIZES["stage3_param_persistence_threshold"]
    )
    # Never above DeepSpeed's own, never below the floor; the largest tensor fits a bucket.
    big = ds_config.zero_sizes({}, largest_unit=10**10, largest_tensor=1)
    assert big["reduce_bucket_size"] == ds_config.DEEPSPEED_SIZES["reduce_bucket_size"]
    assert ds_config.zero_sizes({}, 10, 10)["reduce_bucket_size"] == ds_config.SMALLEST_BUCKET
    assert ds_config.zero_sizes({}, 10, 5_000_000)["allgather_bucket_size"] == 5_000_000
    # A model up to WHOLE_MODEL_BUCKET elements has one bucket for all of it (DeepSpeed's collectives per step);
    # a bigger one at least that much beside its largest block.
    small = ds_config.zero_sizes({}, largest_unit=800_000, largest_tensor=130_000, total=3_300_000)
    assert small["reduce_bucket_size"] == small["sub_group_size"] == small["stage3_prefetch_bucket_size"] == 3_300_000
    bigger = ds_config.zero_sizes({}, largest_unit=2_000_000, largest_tensor=1, total=10**9)
    assert bigger["reduce_bucket_size"] == ds_config.WHOLE_MODEL_BUCKET
    mine = ds_config.zero_sizes({"reduce_bucket_size": 123, "stage3_prefetch_bucket_size": "auto"}, 12_000_000, 1)
    assert mine["reduce_bucket_size"] == 123 and mine["stage3_prefetch_bucket_size"] == 12_000_000


def test_the_command_prints_every_backend_at_each_world_size(capsys):
    assert main(["estimate", f"{__name__}:tied", "--world-sizes", "2,8", "--optimizer", "sgd-momentum"]) == 0
    out = capsys.readouterr().out
    assert "Tied" in out and "sgd-momentum" in out
    rows = [line.split("|")[1:3] for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    got = {(b.strip(), int(n)) for b, n in rows}
    for name in ("ddp", "fsdp", "deepspeed zero3", "horovod"):
        assert {(name, 2), (name, 8)} <= got, name
    assert ("single", 1) in got and ("single", 2) not in got


def test_a_hugging_face_config_file(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 100,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    model, what = estimate.build_on_meta(str(path))
    h, i, v = 64, 128, 100
    layer = 4 * h * h + 3 * h * i + 2 * h
    assert estimate.count_model(model).numel == 2 * layer + 2 * v * h + h
    assert "LlamaForCausalLM" in what
    assert main(["estimate", str(path), "--world-sizes", "4", "--backends", "fsdp,ddp"]) == 0
    assert "| fsdp | 4 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
        (f"{__name__}:missing", "has no 'missing'; its callables: .*tied"),
        (f"{__name__}:MiB", "is a int, not a function"),
        (f"{__name__}:test_counts_each_tensor_once_by_dtype_on_meta", "returned a NoneType, not a torch.nn.Module"),
        ("nowhere/model.py:build", "no file nowhere/model.py"),
        ("bad..name", "neither module:function nor a Hugging Face config"),  # not a hub name: no download tried
        ("configs/missing.json", "configs/missing.json: no such file"),
    ],
)
def test_a_bad_model_path_is_one_clear_error(spec, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["estimate", spec])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(says, err), err


def test_a_file_factory(tmp_path, capsys):
    (tmp_path / "mymodel.py").write_text("from torch import nn\ndef build():\n    return nn.Linear(1000, 1000)\n")
    assert main(["estimate", f"{tmp_path}/mymodel.py:build", "--world-sizes", "2", "--backends", "ddp"]) == 0
    assert "1.0 M parameters" in capsys.readouterr().out


def test_unknown_backend_and_bad_world_sizes(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", f"{__name__}:tied", "--backends", "ddp,nope"])
    assert "unknown backend nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate", f"{__name__}:tied", "--world-sizes", "0,2"])
    assert "processes >= 1" in capsys.readouterr().err
