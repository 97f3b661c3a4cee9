"""DeepSpeed's tutorial launch line under the real deepspeed launcher: ``--deepspeed
--deepspeed_config ds_config.json`` on a script that ran ``deepspeed.add_config_arguments``.
The tutorial's own config (an ``optimizer`` and a ``WarmupLR`` ``scheduler`` section beside the
script's optimizer and scheduler, which trained at lr 0 with exit 0) is refused with what to write;
without those sections the run trains, and one line on rank 0 says what it took from the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launching import launch, require_launcher

pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(600)]

WORKER = "tests/support/ds_config_worker.py"

#: DeepSpeedExamples' training/cifar/cifar10_deepspeed.py's config (fp16 off: these runs are on the CPU).
TUTORIAL = {
    "train_batch_size": 16,
    "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "bf16": {"enabled": False},
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 0, "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000},
}


def run(tmp_path: Path, config: dict) -> tuple[int, str]:
    require_launcher("deepspeed")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    res = launch("deepspeed", [WORKER, "--deepspeed", "--deepspeed_config", str(path), "--stage", "2"], timeout=300)
    return res.returncode, res.output


def test_the_tutorials_config_is_refused_not_trained_at_lr_0(tmp_path):
    code, output = run(tmp_path, TUTORIAL)
    assert code != 0, output[-3000:]
    assert "the config has 'optimizer' and 'scheduler' section(s)" in output, output[-3000:]
    assert "torch.optim.AdamW(model.parameters(), lr=0.001, betas=(0.8, 0.999), eps=1e-08" in output
    assert "trained:" not in output


def test_without_its_sections_it_trains_and_says_what_it_took_once(tmp_path):
    config = {k: v for k, v in TUTORIAL.items() if k not in ("optimizer", "scheduler")}
    code, output = run(tmp_path, config)
    assert code == 0, output[-3000:]
    assert "trained: zero stage 2, lrs [0.0, 0.0005, 0.001, 0.001]" in output, output[-3000:]
    lines = [ln for ln in output.splitlines() if "deepspeed: from the config," in ln]
    assert len(lines) == 1, lines  # one line, rank 0's
    line = lines[0]
    assert "adopted gradient_clipping=1.0 as --clip-grad-norm 1.0" in line
    assert "zero_optimization.stage=0 (--zero-stage 2)" in line and "train_batch_size=16 (dropped" in line
    assert "warning: the script's own" not in output  # its --local_rank and DeepSpeed's options are fine
