"""What a recipe run leaves in its ``--out-dir`` besides the weights: the
per-epoch history (``history.csv``), the final figures (``metrics.json``) and
their plot (``training_results.png``).  Written by the main rank only."""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from parallelx import Backend, storage
from parallelx.errors import ParallelxError
from parallelx.storage import Location

#: The options ``metrics.json`` records under "config" (those a recipe has).
CONFIG_KEYS = (
    "epochs",
    "batch_size",
    "out_dir",
    "seed",
    "num_workers",
    "max_steps",
    "lr_schedule",
    "warmup_epochs",
    "checkpoint_every",
    "resume",
    "keep_checkpoints",
    "checkpoint_async",
)


def make_out_dir(backend: Backend, out: Location) -> None:
    """The main rank creates ``out`` (in a store: checks that it answers and that its bucket exists);
    a failure stops every rank (the others would otherwise train on and wait for it in the first
    collective)."""
    error = None
    if backend.is_main():
        try:
            storage.probe(out)
            storage.makedirs(out)
        except ParallelxError as exc:
            error = f"{exc}; choose another --out-dir"
        except OSError as exc:
            error = f"cannot create the output directory {out} ({exc.strerror or exc}); choose another --out-dir"
    error = backend.broadcast(error, src=0)
    if error is not None:
        raise ParallelxError(error)


def shown(out: Location) -> str:
    """``out`` as the last line prints it: a local folder's absolute path, or the URL."""
    return str(out.resolve()) if isinstance(out, Path) else storage.show(out)


def epoch_row(epoch: int, train: dict[str, Any], val: dict[str, Any]) -> dict[str, float]:
    """One line of ``history.csv``, from the two passes' figures: ``MetricSums``'
    ``loss``, ``acc`` and ``count``, the pass's ``seconds``, and for training
    ``lr``, ``grad_norm``, ``steps`` and ``skipped``."""
    return {
        "epoch": epoch,
        "train_loss": train["loss"],
        "train_acc": train["acc"],
        "val_loss": val["loss"],
        "val_acc": val["acc"],
        "epoch_time_s": train["seconds"] + val["seconds"],
        "train_images_per_s": train["count"] / train["seconds"],
        "val_images_per_s": val["count"] / val["seconds"],
        "lr": train["lr"],
        "grad_norm": train["grad_norm"],
        "optimizer_steps": train["steps"],
        "skipped_steps": train["skipped"],
    }


def final_metrics(
    backend: Backend,
    args: argparse.Namespace,
    history: list[dict[str, float]],
    *,
    best_acc: float,
    best_epoch: int,
    total_s: float,
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``metrics.json`` holds (and ``fit`` returns): best and final val
    figures, time, backend, world size, the configuration and loop options."""
    return {
        "best_val_acc": best_acc,
        "best_epoch": best_epoch,
        "final_val_loss": history[-1]["val_loss"],
        "final_val_acc": history[-1]["val_acc"],
        "total_time_s": total_s,
        "backend": backend.name,
        "world_size": backend.world_size,
        "train_images_per_s": sum(h["train_images_per_s"] for h in history) / len(history),
        "config": run_config(args),
        "loop": asdict(backend.options),
        **(run_info or {}),
    }


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options as ``metrics.json`` records them."""
    # Paths as text; a URL without any user:password in it.
    return {
        k: storage.show(v) if isinstance(v, (Path, str)) else v
        for k in CONFIG_KEYS
        if hasattr(args, k)
        for v in [getattr(args, k)]
    }


def write_outputs(out: Location, metrics: dict[str, Any], history: list[dict[str, float]]) -> None:
    """``metrics.json``, ``history.csv`` and ``training_results.png`` (main rank only), each
    replaced whole (a local file by a rename, an object by one upload)."""
    storage.write_text(storage.join(out, "metrics.json"), json.dumps(metrics, indent=2) + "\n")
    write_history(out, history)
    plot(storage.join(out, "training_results.png"), history)


def write_history(out: Location, history: list[dict[str, float]]) -> None:
    import pandas as pd

    text = pd.DataFrame(history).to_csv(index=False)
    storage.write_text(storage.join(out, "history.csv"), text)


def plot(path: Location, history: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    keys = [k for k in ("acc", "loss") if f"train_{k}" in history[0]]  # a language model has no accuracy
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5 * (len(keys) + 1), 4))
    ax_lr = axes[-1]
    ax_lr.plot(epochs, [h["lr"] for h in history], "o-", color="tab:green", label="lr (end of epoch)")
    ax_lr.set_xlabel("epoch")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("learning rate and gradient norm")
    ax_norm = ax_lr.twinx()
    ax_norm.plot(epochs, [h["grad_norm"] for h in history], "s--", color="tab:red", label="grad norm (mean)")
    ax_norm.set_ylabel("gradient norm before clipping")
    ax_lr.legend(loc="upper left")
    ax_norm.legend(loc="upper right")
    ax_lr.xaxis.get_major_locator().set_params(integer=True)
    for ax, key in zip(axes, keys):
        ax.plot(epochs, [h[f"train_{key}"] for h in history], "o-", label="train")
        ax.plot(epochs, [h[f"val_{key}"] for h in history], "o-", label="val")
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.set_title(f"{key}: train vs val")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    storage.write(path, lambda f: f.write(image.getvalue()))
