"""The recipes section: CIFAR-10 LeNet and Dogs-vs-Cats VGG16 on every
backend under its launcher; the val figures each run reports must equal a
single-process evaluation of its ``best.pth``."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..check import Fail, Outcome, Skip
from ..launching import unavailable
from ..report import Item, section_status
from ..settings import BACKEND_ARGS
from .base import Steps


class RecipeSteps(Steps):
    def make_data(self) -> None:
        def cifar() -> Outcome:
            from parallelx.recipes.make_data import make_cifar10

            make_cifar10(self.data / "cifar10", n_train=self.settings.cifar_train, n_test=self.settings.cifar_test,
                         seed=0)
            return Outcome(f"{self.settings.cifar_train} train / {self.settings.cifar_test} test images")

        def dogcat() -> Outcome:
            from parallelx.recipes.make_data import make_dogcat

            make_dogcat(self.data / "dogcat", n_per_class=self.settings.dogcat_per_class, seed=0, csv=True)
            return Outcome(f"{2 * self.settings.dogcat_per_class} JPEGs")

        self.step("recipes", "generated CIFAR-10 data", cifar)
        self.step("recipes", "generated Dogs-vs-Cats data", dogcat)

    # ---------------------------------------------------------- recipes

    def recipes(self, recipe: str, backends: Sequence[str]) -> None:
        for backend in backends:
            if backend not in self.settings.recipe_backends[recipe]:
                self.skip("recipes", f"{recipe} on {backend}", self.settings.fewer_because)
                continue
            self.step("recipes", f"{recipe} on {backend}", lambda b=backend: self._recipe(recipe, b),
                      need_s=30)

    def _recipe(self, recipe: str, backend: str) -> Outcome:
        import torch

        import parallelx

        if (why := unavailable(backend)) is not None:
            raise Skip(why)
        n = self.n_for(backend)
        out = self.work / "runs" / f"{recipe}-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        extra = self.settings.cifar_args if recipe == "cifar10" else self.settings.dogcat_args
        target = ["-m", f"parallelx.recipes.{recipe}", "--backend", backend, *BACKEND_ARGS.get(backend, ()),
                  "--data-dir", str(self.data / recipe), "--out-dir", str(out), "--epochs", "1", *extra]
        timeout = self.timeout(self.settings.launch_timeout_s)
        res = self.runner.launch(backend, target, n, timeout_s=timeout, log_name=f"{recipe}-{backend}")
        output = res.output()
        if res.error():
            raise Fail(f"{parallelx.backend_class(backend).launcher.name} {res.error()}", log=output)
        metrics_file = out / "metrics.json"
        if not metrics_file.is_file():
            raise Fail(f"exited 0 but wrote no {metrics_file}", log=output)
        metrics = json.loads(metrics_file.read_text())
        world = n
        if metrics.get("backend") != backend or metrics.get("world_size") != world:
            raise Fail(f"metrics.json says backend {metrics.get('backend')!r}, world size {metrics.get('world_size')}; "
                       f"expected {backend!r} and {world}", log=output)
        batch = int(extra[extra.index("--batch-size") + 1])
        ref = self._reference(recipe, out / "best.pth", batch)
        rel = abs(metrics["final_val_loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
        figures = {"val_acc": metrics["best_val_acc"], "reference_acc": ref["acc"],
                   "val_loss": metrics["final_val_loss"], "loss_rel_diff": rel,
                   "images_per_s": metrics.get("train_images_per_s"), "launch_s": res.seconds}
        device = "GPU" if self.cuda else "CPU"
        how = f"{parallelx.backend_class(backend).launcher.name}, {world} process{'es' if world > 1 else ''}"
        if backend == "dp":
            gpus = torch.cuda.device_count() if self.cuda else 0
            how = (f"DataParallel over {gpus} GPUs" if gpus > 1 else
                   "ran as single: DataParallel needs 2 GPUs to split a batch")
        if metrics["best_val_acc"] != ref["acc"] or rel > self.settings.loss_rtol:
            raise Fail(f"reported val acc {metrics['best_val_acc']} and loss {metrics['final_val_loss']:.6g}; a "
                       f"single-process evaluation of best.pth gives {ref['acc']} and {ref['loss']:.6g} "
                       f"(loss relative tolerance {self.settings.loss_rtol:g})", log=output, figures=figures)
        return Outcome(f"{how} on the {device}; val acc {ref['acc']:.4f} over {ref['count']} images equals "
                       f"best.pth's, loss within {rel:.1e}", figures)

    def _reference(self, recipe: str, best: Path, batch: int) -> dict[str, float]:
        """A single-process evaluation of ``best.pth`` on the run's device, in the run's val batches."""
        import torch

        from parallelx.recipes.engine import evaluate_state_dict

        if recipe == "cifar10":
            from parallelx.recipes.data import load_cifar10
            from parallelx.recipes.models import LeNet

            model = LeNet()
            model.load_state_dict(torch.load(best, map_location="cpu", weights_only=True))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the generated data's md5 sums are not the official ones
                val = load_cifar10(self.data / recipe)[1]
        else:
            from parallelx.recipes.data import load_dogcat
            from parallelx.recipes.models import vgg16_for_dogcat

            model = vgg16_for_dogcat(weights=best)
            val = load_dogcat(self.data / recipe, self.settings.dogcat_size)[1]
        device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        try:
            return evaluate_state_dict(model.to(device), OnDevice(val, device), batch_size=batch)
        finally:
            del model
            if self.cuda:
                torch.cuda.empty_cache()

    def dp_scatter(self) -> None:
        name = "DataParallel scatter over GPUs"
        if not self.cuda:
            self.skip("recipes", name, "CUDA only (and needs 2 GPUs)", needs="cuda")
            return
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 2:
            self.skip("recipes", name, f"needs 2 GPUs, {gpus} visible: the dp runs above ran as single", needs="cuda")
            return
        dp = [i for i in self.items if i.section == "recipes" and i.name.endswith(" on dp")]
        status = section_status(dp)
        self.record(Item("recipes", name, status, f"the dp runs above split each batch over {gpus} GPUs",
                         needs="cuda"))


class OnDevice:
    """A dataset whose samples are already on ``device``: the recipes'
    single-process evaluation (``evaluate_state_dict``) then runs there."""

    def __init__(self, dataset: Any, device: Any) -> None:
        self.dataset, self.device = dataset, device

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        x, y = self.dataset[index]
        return x.to(self.device), torch.as_tensor(y, device=self.device)
