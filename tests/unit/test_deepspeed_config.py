"""A DeepSpeed config never changes the math silently (``backends/_deepspeed_config.py``): its
``optimizer`` and ``scheduler`` sections are refused with the torch form of each, a dict in code
is the same config as a file, and one start-up line says what the run adopts, keeps and overrides.
Built without joining a world (the engine itself runs in tests/launcher/test_deepspeed_config_launch.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import parallelx
from parallelx.errors import ParallelxError

pytestmark = pytest.mark.timeout(60)


def tutorial_config(stage: int = 0) -> dict[str, Any]:
    """The shape of DeepSpeed's CIFAR-10 tutorial config (DeepSpeedExamples, training/cifar)."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {
            "enabled": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50000000, "overlap_comm": True},
    }


def without(cfg: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in keys}


@pytest.mark.parametrize("given", ["dict", "file"])
def test_a_config_scheduler_beside_the_scripts_cannot_train_at_lr_0(tmp_path, given):
    """The tutorial's config beside a script's own optimizer and scheduler: DeepSpeed's WarmupLR would set
    the lr to 0 at the engine's build, the script's LambdaLR take 0 as its base lr, and every step run at 0
    with exit 0.  Refused before anything is built, with the torch form of each section."""
    cfg: Any = tutorial_config()
    if given == "file":
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(cfg))
        cfg = str(path)
    with pytest.raises(ParallelxError) as err:
        parallelx.get_backend("deepspeed", config=cfg)
    msg = str(err.value)
    assert "'optimizer' and 'scheduler' section(s)" in msg
    # DeepSpeed's Adam is AdamW (adam_w_mode defaults to true), its weight decay written out.
    assert "torch.optim.AdamW(model.parameters(), lr=0.001, betas=(0.8, 0.999), eps=1e-08, weight_decay=3e-07)" in msg
    assert "LambdaLR" in msg and "first two steps at warmup_min_lr=0" in msg and "docs/from-deepspeed.md" in msg


def test_each_section_alone_is_refused_and_says_what_to_write():
    cfg = tutorial_config()
    with pytest.raises(ParallelxError, match=r"has 'scheduler' section\(s\).*WarmupLR"):
        parallelx.get_backend("deepspeed", config=without(cfg, "optimizer"))
    adam = {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}}
    with pytest.raises(
        ParallelxError, match=r"torch\.optim\.Adam\(model\.parameters\(\), lr=0\.01, weight_decay=0\.0\)"
    ):
        parallelx.get_backend("deepspeed", config={"optimizer": adam})
    with pytest.raises(ParallelxError, match="no torch optimizer is OneBitAdam"):
        parallelx.get_backend("deepspeed", config={"optimizer": {"type": "OneBitAdam"}})
    # A warm-up the script writes itself, from lr 0 on purpose, is its own business: nothing to refuse.
    parallelx.get_backend("deepspeed", config=without(cfg, "optimizer", "scheduler"))


def test_a_config_dict_in_code_is_the_same_config_as_a_file(tmp_path):
    cfg = without(tutorial_config(stage=2), "optimizer", "scheduler")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    from_file = parallelx.get_backend("deepspeed", config=path, precision="bf16-mixed")
    from_dict = parallelx.get_backend("deepspeed", config=cfg, precision="bf16-mixed")
    assert from_dict.strategy.config == from_file.strategy.config
    assert from_dict.options == from_file.options and from_dict.options.clip_grad_norm == 1.0
    assert from_dict.strategy.config_line == from_file.strategy.config_line
    assert from_dict.strategy.zero_stage == 2
    # The dict given is not changed by the backend.
    assert cfg == without(tutorial_config(stage=2), "optimizer", "scheduler")


def test_one_line_says_what_is_adopted_kept_and_overridden():
    cfg = without(tutorial_config(stage=0), "optimizer", "scheduler")
    backend = parallelx.get_backend("deepspeed", config=cfg, zero_stage=2, accumulate=2)
    line, warns = backend.strategy.config_line
    assert "\n" not in line and warns  # the config's clipping changes the update: a warning
    assert "adopted gradient_clipping=1.0 as --clip-grad-norm 1.0 (clipped by parallelx" in line
    assert "overridden: zero_optimization.stage=0 (--zero-stage 2)" in line
    assert "train_batch_size=16 (dropped" in line
    assert "kept for DeepSpeed's engine:" in line and "zero_optimization's reduce_bucket_size, overlap_comm" in line
    config = backend.strategy.config
    assert config["gradient_clipping"] == 0.0  # parallelx clips, as on every backend
    assert "train_batch_size" not in config and config["gradient_accumulation_steps"] == 2
    # Under 16-mixed DeepSpeed's float16 engine takes the config's loss-scaler settings.
    half = parallelx.get_backend("deepspeed", config=cfg, precision="16-mixed").strategy
    line, _ = half.config_line
    assert "fp16's loss scaler under --precision 16-mixed (loss_scale=0, initial_scale_power=15" in line
    assert half.config["fp16"]["loss_scale_window"] == 500 and half.config["fp16"]["enabled"] is True
    # A config that only tunes the engine is a plain line, not a warning.
    tuned = parallelx.get_backend("deepspeed", config={"zero_optimization": {"stage": 1}}).strategy
    assert tuned.config_line == ("deepspeed: from the config, adopted zero_optimization.stage=1", False)
    assert parallelx.get_backend("deepspeed").strategy.config_line is None  # no config, no line


def test_a_train_batch_size_the_world_does_not_divide_is_not_handed_to_deepspeed():
    # DeepSpeed checks train_batch_size == micro x accumulation x world: 16 at 3 processes would fail inside it,
    # for a number only its bookkeeping reads (the batch is the script's loader's).
    config = parallelx.get_backend("deepspeed", config={"train_batch_size": 16}).strategy.config
    assert "train_batch_size" not in config and config["train_micro_batch_size_per_gpu"] == 1
