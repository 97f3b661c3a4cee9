"""Training-state checkpoints under a real launcher: save, continue, reload, continue.

    torchrun --nproc-per-node 2 tests/support/trainstate_worker.py --backend ddp --out DIR
    deepspeed --num_gpus 2 tests/support/trainstate_worker.py --backend deepspeed --zero-stage 3 --out DIR

For SGD with momentum and for AdamW: train 3 steps, save, train 2 more
(weights A); then build everything afresh (other initial weights), load the
checkpoint and train 2 steps (weights B).  Rank 0 writes
``DIR/result-<optimizer>.pt`` for ``tests/launcher/test_trainstate_launch.py``.  With
``--load-from RUN_DIR`` it only loads the newest checkpoint under
``RUN_DIR/<optimizer>`` (written by another backend) and trains 2 steps.

The helpers (``Run``) are also used in-process by ``tests/unit/test_trainstate.py``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parallelx

DATASET_SIZE = 23  # odd: the sampler pads, and a pass ends mid-batch
BATCH = 3
SAVE_AT = 3
MORE = 2
LOADER_SEED = 1


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(DATASET_SIZE, 8, generator=g) * 3, torch.randint(0, 4, (DATASET_SIZE,), generator=g)
    return TensorDataset(x, y, torch.arange(DATASET_SIZE))  # the index: which samples a rank trained on


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-2)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    raise ValueError(name)


class Run:
    """One model, optimizer, scheduler, sampler and loader, and a loop that
    can stop and continue anywhere (its counters say where)."""

    def __init__(
        self,
        backend: parallelx.Backend,
        optim: str,
        *,
        init_seed: int = 0,
        hidden: int = 16,
        dropout: float = 0.2,
        noise: bool = True,
    ) -> None:
        self.noise = noise
        torch.manual_seed(init_seed)
        model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 4))
        self.backend = backend
        self.model, self.optimizer = backend.setup(model, make_optimizer(optim, model))
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.sampler = backend.make_sampler(dataset(), shuffle=True, seed=1)
        # Its own generator: each iter(loader) draws a seed, which must not come
        # from the global RNG (a resumed run starts one iterator more).
        self.loader = DataLoader(
            dataset(), batch_size=BATCH, sampler=self.sampler, generator=torch.Generator().manual_seed(LOADER_SEED)
        )
        self.counters = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "samples_seen": 0}
        self.seen: list[int] = []  # dataset indices this rank trained on
        self._batches = None

    def _stream(self):
        while True:
            self._left = len(self.loader)  # batches in this pass (a resumed one is shorter)
            yield from self.loader

    def train(self, steps: int) -> None:
        if self._batches is None:
            self._batches = self._stream()
        for _ in range(steps):
            x, y, index = next(self._batches)
            self.seen += index.tolist()
            # Python's and NumPy's generators feed the loss, torch's the dropout:
            # a resume that restores any of them wrongly changes the weights.
            noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand()) if self.noise else 1.0
            loss = nn.functional.cross_entropy(self.model(x.to(self.backend.device)), y.to(self.backend.device)) * noise
            self.backend.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.counters["global_step"] += 1
            self.counters["step_in_epoch"] += 1
            self.counters["samples_seen"] += len(x) * self.backend.world_size
            self._left -= 1
            if self._left == 0:  # the epoch is over when its last batch is, not at the next one
                self.counters["epoch"] += 1
                self.counters["step_in_epoch"] = 0

    def save(self, directory: Path, **kw: Any) -> Path:
        return parallelx.save_training_state(
            self.backend,
            directory,
            step=self.counters["global_step"],
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
            counters=self.counters,
            loader_seed=LOADER_SEED,
            **kw,
        )

    def load(self, path: Path) -> dict[str, Any]:
        info = parallelx.load_training_state(
            self.backend,
            path,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
        )
        self.counters = dict(info["counters"])
        return info

    def weights(self) -> dict[str, torch.Tensor]:
        return self.backend.model_state_dict(self.model)


def engine_steps(optimizer: Any) -> int | None:
    engine = getattr(optimizer, "engine", None)
    return None if engine is None else int(engine.global_steps)


def max_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two nested states (inf when their structure differs)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return float("inf")
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return float("inf")
        return max([max_diff(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max([max_diff(x, y) for x, y in zip(a, b)], default=0.0)
    return 0.0 if a == b else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parallelx.add_arguments(parser)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--load-from", type=Path, default=None)
    args = parser.parse_args()
    backend = parallelx.from_args(args)
    with backend:
        for optim in ("sgd", "adamw"):
            result: dict[str, Any] = {"world_size": backend.world_size}
            # No dropout or loss noise here: the backends' runs are compared with
            # each other, and their ranks' generators need not agree across
            # backends (the in-process tests check that they continue exactly).
            a = Run(backend, optim, dropout=0.0, noise=False)
            a.train(SAVE_AT)
            path = a.save(args.out / optim)
            a.train(MORE)
            result.update(
                A=a.weights(), rng_A=torch.rand(4), engine_A=engine_steps(a.optimizer), counters_A=dict(a.counters)
            )
            result.update(resume(backend, path, "B"))
            if backend.is_main():
                torch.save(result, args.out / f"result-{optim}.pt")
            if args.load_from is not None:  # a checkpoint another backend wrote
                foreign = parallelx.latest_checkpoint(args.load_from / optim)
                assert foreign is not None, f"no checkpoint under {args.load_from / optim}"
                cross = resume(backend, foreign, "C")
                if backend.is_main():
                    torch.save(cross, args.out / f"cross-{optim}.pt")


def resume(backend: parallelx.Backend, path: Path, tag: str) -> dict[str, Any]:
    """Build everything afresh (other initial weights), load ``path``, check
    that what was loaded is what the file holds, train ``MORE`` steps."""
    optim = parallelx.checkpoints.trainstate._optimizer_type
    saved = torch.load(path / "state.pt", weights_only=True)
    run = Run(
        backend, "sgd" if saved["meta"]["optimizer"] == "SGD" else "adamw", init_seed=99, dropout=0.0, noise=False
    )
    assert optim(run.optimizer) == saved["meta"]["optimizer"]
    info = run.load(path)
    loaded = backend.named_optimizer_state(run.model, run.optimizer)
    out = {
        "loaded_optimizer_diff": max_diff(
            {k: loaded[k] for k in ("state", "param_groups")},
            {k: saved["optimizer"][k] for k in ("state", "param_groups")},
        ),
        "loaded_model_diff": max_diff(run.weights(), saved["model"]),
        "engine_loaded": engine_steps(run.optimizer),
        "info": info,
        "path": str(path),
    }
    run.train(MORE)
    out.update(
        {
            tag: run.weights(),
            f"rng_{tag}": torch.rand(4),
            f"engine_{tag}": engine_steps(run.optimizer),
            f"counters_{tag}": dict(run.counters),
            "portable": backend.optimizer_state_dict(run.optimizer),
        }
    )
    return out


if __name__ == "__main__":
    main()
