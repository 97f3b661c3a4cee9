"""The check's sections (install, environment, recipes, throughput, fsdp, transformers, host-sync) as the steps
of :class:`GpuCheck`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .check import (
    BACKEND_ARGS,
    BUDGET_S,
    COMPILE,
    CUDA,
    ENTRY,
    FAILED,
    GPT_BACKEND_ARGS,
    GPT_CASES,
    HOROVOD_CHECKS_S,
    OFFLOAD,
    PASSED,
    PRECISIONS,
    RESERVE_S,
    ROOT,
    SYNC_EXCESS_LIMIT,
    TENSOR_PARALLEL,
    Check,
    Fail,
    Item,
    Outcome,
    Settings,
    Skip,
    unavailable,
)

HOROVOD_BUILD = "Horovod built with NCCL operations"


class GpuCheck(Check):
    """Every section's steps, recorded in one report; ``scripts/gpu_check.py`` runs them in order."""

    def __init__(self, args: argparse.Namespace, settings: Settings, nproc: int) -> None:
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
        super().__init__(
            Path(args.out), work.resolve(), args.deadline or time.time() + BUDGET_S, settings, nproc, only=args.only
        )
        self.args, self.horovod_wheels = args, self.work / "horovod-wheel"
        self.horovod_build: subprocess.Popen[Any] | None = None
        self.gpt_losses: dict[str, float] = {}  # each backend's GPT run without options: the others' twin

    # ------------------------------------------------------------ install

    def start_horovod_build(self) -> None:
        """Horovod has no wheel for current torch: build its carried sdist with
        NCCL operations in the background (at low priority) while the other
        checks use the GPU; its own checks run at the end if it finished."""
        sdist = next(Path(self.args.wheels).glob("horovod-*.tar.gz"), None) if self.args.wheels else None
        if not self.cuda:
            self.skip(
                "install",
                HOROVOD_BUILD,
                "CUDA only: the NCCL build needs a GPU and nvcc"
                + (" (the dry run uses the Horovod already installed)" if not unavailable("horovod") else ""),
                needs="cuda",
            )
        elif importlib.util.find_spec("horovod") is not None:
            self.skip("install", HOROVOD_BUILD, "Horovod is already installed here; its build was not repeated")
        elif sdist is None:
            self.skip(
                "install",
                HOROVOD_BUILD,
                f"no Horovod sdist in {self.args.wheels}: run scripts/gpu_wheels.py and carry gpu-wheels/",
            )
        elif shutil.which("nvcc") is None:
            self.skip("install", HOROVOD_BUILD, "nvcc is not on PATH: the NCCL build needs the CUDA compiler")
        else:
            from parallelx.launching.runner import job_env

            self.horovod_log = self.logs / "horovod-build.log"
            print(f"[gpu-check] install / building Horovod in the background (log {self.horovod_log})", flush=True)
            self.horovod_started = time.monotonic()
            with self.horovod_log.open("w") as log:  # the child keeps its own copy of the descriptor
                self.horovod_build = subprocess.Popen(
                    [
                        sys.executable,
                        str(ENTRY),
                        "--build-horovod",
                        str(Path(sdist).resolve()),
                        "--wheel-dir",
                        str(self.horovod_wheels),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.work,
                    start_new_session=True,
                    preexec_fn=lambda: os.nice(10),
                    env=job_env(None, self.env(600)),
                )

    def finish_horovod_build(self, proc: subprocess.Popen[Any]) -> None:
        """Wait for the background build while time is left for Horovod's own checks, then install it."""

        def finish() -> Outcome:
            try:
                rc = proc.wait(timeout=max(1.0, self.remaining() - RESERVE_S - HOROVOD_CHECKS_S))
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise Skip(
                    f"the build had not finished after {time.monotonic() - self.horovod_started:.0f}s, "
                    f"and Horovod's checks need the last {HOROVOD_CHECKS_S:.0f}s of the budget; "
                    "Horovod was not checked"
                ) from None
            log = self.horovod_log.read_text(errors="replace")
            wheels = sorted(self.horovod_wheels.glob("horovod-*.whl"))
            if rc != 0 or not wheels:
                raise Fail(
                    f"the build exited with status {rc}"
                    if rc
                    else f"the build wrote no wheel into {self.horovod_wheels}",
                    log=log,
                )
            target = ["--target", str(Path(self.args.site).resolve()), "--upgrade"] if self.args.wheels else []
            res = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--no-index",
                    "--no-deps",
                    "--disable-pip-version-check",
                    *target,
                    str(wheels[-1]),
                ],
                capture_output=True,
                text=True,
            )
            if res.returncode != 0:
                raise Fail(f"pip could not install {wheels[-1].name}", log=res.stdout + res.stderr)
            from parallelx.launching.runner import job_env

            # nccl_built() is NCCL's version code, 0 without NCCL; stdout apart, so that a warning cannot hide it.
            probe = subprocess.run(
                [sys.executable, "-c", "import horovod.torch as h; print(h.nccl_built())"],
                capture_output=True,
                text=True,
                cwd=self.work,
                env=job_env(None, self.env(60)),
            )
            code = probe.stdout.strip().splitlines()[-1:]
            if probe.returncode != 0 or not code or not code[0].isdigit() or int(code[0]) == 0:
                raise Fail(
                    "the built Horovod does not load with NCCL operations (horovod.torch.nccl_built())",
                    log=probe.stdout + probe.stderr,
                )
            return Outcome(
                f"{wheels[-1].name}, NCCL operations built (NCCL {code[0]}), "
                f"in {time.monotonic() - self.horovod_started:.0f}s"
            )

        self.step("install", HOROVOD_BUILD, finish, needs="cuda")

    # ------------------------------------------------------------ environment

    def environment(self) -> None:
        self.step("environment", "versions", self._versions)
        if self.cuda:
            self.step("environment", "GPU, CUDA, NCCL and cuDNN", self._gpu, needs="cuda")
        else:
            self.skip(
                "environment", "GPU, CUDA, NCCL and cuDNN", "CUDA only: the dry run runs on the CPU", needs="cuda"
            )
        self.step("environment", "python -m parallelx env", self._parallelx_env, need_s=20)
        self.step("environment", "installed parallelx is this checkout", self._same_source)

    def _versions(self) -> Outcome:
        import parallelx
        from parallelx.launching.envreport import versions

        self.facts.update(
            versions(),
            executable=sys.executable,
            cpu_cores=os.cpu_count(),
            parallelx=f"{parallelx.__version__} at {Path(parallelx.__file__).parent}",
        )
        return Outcome(", ".join(f"{k} {self.facts[k]}" for k in ("torch", "parallelx", "deepspeed", "horovod")))

    def _gpu(self) -> Outcome:
        import torch

        gpus = [
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}, "
            f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count())
        ]
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        facts = {
            "gpus": f"{len(gpus)} x {gpus[0]}" if len(set(gpus)) == 1 else ", ".join(gpus),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "cudnn": torch.backends.cudnn.version(),
            "driver": _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "nvcc": (_first_line(["nvcc", "--version"], "release") or "").split("release")[-1].strip() or None,
            "tf32_conv": torch.backends.cudnn.allow_tf32,
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        }
        self.facts.update(facts)
        if facts["nccl"] is None:
            raise Fail("torch reports no NCCL: the ddp backend cannot use the GPUs", figures=facts)
        return Outcome(
            f"{facts['gpus']}; CUDA {facts['cuda']}, NCCL {facts['nccl']}, cuDNN {facts['cudnn']}, "
            f"driver {facts['driver']}"
        )

    def _parallelx_env(self) -> Outcome:
        done = self.launch("single", ["-m", "parallelx", "env"], timeout_s=self.timeout(120), log_name="parallelx-env")
        self.env_text = done.output
        if done.error():
            raise Fail(f"`python -m parallelx env` {done.error()}", log=done.output)
        usable = [line.split()[1] for line in done.output.splitlines() if line.strip().startswith("[OK]")]
        return Outcome(f"usable here: {', '.join(usable) or 'none'}")

    def _same_source(self) -> Outcome:
        import parallelx

        installed = Path(parallelx.__file__).resolve().parent
        if installed == (ROOT / "parallelx").resolve():
            raise Skip("parallelx runs from this checkout (an editable install): nothing to compare")
        differ = [
            f"{src}/{path.name}"
            for src, dest in (
                ("parallelx", installed),
                ("backends", installed / "backends"),
                ("recipes", installed / "recipes"),
            )
            for path in sorted((ROOT / src).glob("*.py"))
            if not (dest / path.name).is_file() or (dest / path.name).read_bytes() != path.read_bytes()
        ]
        if differ:
            raise Fail(
                f"the installed parallelx ({installed}) differs from this checkout in {', '.join(differ[:6])}"
                f"{' ...' if len(differ) > 6 else ''}: the wheel is stale; run scripts/gpu_wheels.py again"
            )
        return Outcome(f"{installed} matches the checkout's sources")

    # ------------------------------------------------------------ recipes

    def make_data(self) -> None:
        from parallelx.recipes.make_data import make_cifar10, make_dogcat

        s = self.settings

        def cifar() -> Outcome:
            make_cifar10(self.data / "cifar10", n_train=s.cifar_train, n_test=s.cifar_test, seed=0)
            return Outcome(f"{s.cifar_train} train / {s.cifar_test} test images")

        def dogcat() -> Outcome:
            make_dogcat(self.data / "dogcat", n_per_class=s.dogcat_per_class, seed=0, csv=True)
            return Outcome(f"{2 * s.dogcat_per_class} JPEGs")

        self.step("recipes", "generated CIFAR-10 data", cifar)
        self.step("recipes", "generated Dogs-vs-Cats data", dogcat)

    def recipes(self, recipe: str, backends: Sequence[str]) -> None:
        for backend in backends:
            if backend not in self.settings.recipe_backends[recipe]:
                self.skip("recipes", f"{recipe} on {backend}", self.settings.fewer_because)
            else:
                self.step("recipes", f"{recipe} on {backend}", lambda b=backend: self._recipe(recipe, b), need_s=30)

    def _recipe(self, recipe: str, backend: str) -> Outcome:
        """The recipe's reported val figures against a single-process evaluation of its ``best.pth``."""
        import torch

        import parallelx

        world = self.nproc if parallelx.describe(backend).launcher.multi_process else 1
        out = self.work / "runs" / f"{recipe}-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        extra = self.settings.cifar_args if recipe == "cifar10" else self.settings.dogcat_args
        done = self.launched(
            backend,
            [
                "-m",
                f"parallelx.recipes.{recipe}",
                "--backend",
                backend,
                *BACKEND_ARGS.get(backend, ()),
                "--data-dir",
                str(self.data / recipe),
                "--out-dir",
                str(out),
                "--epochs",
                "1",
                *extra,
            ],
            cap=self.settings.launch_timeout_s,
            log_name=f"{recipe}-{backend}",
        )
        if not (out / "metrics.json").is_file():
            raise Fail(f"exited 0 but wrote no {out / 'metrics.json'}", log=done.output)
        metrics = json.loads((out / "metrics.json").read_text())
        if metrics.get("backend") != backend or metrics.get("world_size") != world:
            raise Fail(
                f"metrics.json says backend {metrics.get('backend')!r}, world size {metrics.get('world_size')}; "
                f"expected {backend!r} and {world}",
                log=done.output,
            )
        ref = self._reference(recipe, out / "best.pth", int(extra[extra.index("--batch-size") + 1]))
        rel = abs(metrics["final_val_loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
        figures = {
            "val_acc": metrics["best_val_acc"],
            "reference_acc": ref["acc"],
            "val_loss": metrics["final_val_loss"],
            "loss_rel_diff": rel,
            "images_per_s": metrics.get("train_images_per_s"),
            "launch_s": done.seconds,
        }
        how = f"{parallelx.describe(backend).launcher.name}, {world} process{'es' if world > 1 else ''}"
        if backend == "dp":
            gpus = torch.cuda.device_count() if self.cuda else 0
            how = (
                f"DataParallel over {gpus} GPUs"
                if gpus > 1
                else "ran as single: DataParallel needs 2 GPUs to split a batch"
            )
        if metrics["best_val_acc"] != ref["acc"] or rel > self.settings.loss_rtol:
            raise Fail(
                f"reported val acc {metrics['best_val_acc']} and loss {metrics['final_val_loss']:.6g}; a "
                f"single-process evaluation of best.pth gives {ref['acc']} and {ref['loss']:.6g} "
                f"(loss relative tolerance {self.settings.loss_rtol:g})",
                log=done.output,
                figures=figures,
            )
        return Outcome(
            f"{how} on the {'GPU' if self.cuda else 'CPU'}; val acc {ref['acc']:.4f} over {ref['count']} "
            f"images equals best.pth's, loss within {rel:.1e}",
            figures,
        )

    def _reference(self, recipe: str, best: Path, batch: int) -> dict[str, float]:
        """A single-process evaluation of ``best.pth`` on the run's device, in the run's val batches."""
        import torch

        from parallelx.recipes.data import load_cifar10, load_dogcat
        from parallelx.recipes.models import LeNet, evaluate_state_dict, vgg16_for_dogcat

        if recipe == "cifar10":
            model = LeNet()
            model.load_state_dict(torch.load(best, map_location="cpu", weights_only=True))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the generated data's md5 sums are not the official ones
                val = load_cifar10(self.data / recipe)[1]
        else:
            model, val = vgg16_for_dogcat(weights=best), load_dogcat(self.data / recipe, self.settings.dogcat_size)[1]
        device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        # Samples moved to the device up front: the evaluation then runs there.
        on_device = [(x.to(device), torch.as_tensor(y, device=device)) for x, y in (val[i] for i in range(len(val)))]
        try:
            return evaluate_state_dict(model.to(device), on_device, batch_size=batch)
        finally:
            del model, on_device
            if self.cuda:
                torch.cuda.empty_cache()

    # ------------------------------------------------------------ throughput

    def throughput(self) -> None:
        for precision, extra in PRECISIONS.items():
            name = f"VGG16 {CUDA.image_size} px, {CUDA.batch}/process, {precision}"
            if not self.cuda:
                self.skip("throughput", name, "CUDA only: VGG16 at 224 px is the GPU workload", needs="cuda")
                name = (
                    f"same-process harness on the CPU (LeNet, {self.settings.batch}/process, {precision}; "
                    "numbers mean nothing)"
                )
                if precision != "fp32":  # the harness is the same for every precision: one launch exercises it
                    self.skip("throughput", name, "dry run: the harness runs once, in fp32")
                    continue
            self.step("throughput", name, lambda e=extra, p=precision: self._throughput(p, e), need_s=45)

    def _throughput(self, precision: str, extra: tuple[str, ...]) -> Outcome:
        """parallelx's DDP step against the plain DDP script's in the same processes (``benchmarks.same_process``)."""
        from benchmarks import stats
        from benchmarks.workload import Case, Plan, cpu_cores

        s, n = self.settings, self.nproc
        out, plan_file = self.work / f"throughput-{precision}", self.work / f"throughput-{precision}.json"
        shutil.rmtree(out, ignore_errors=True)
        case = Case(
            model=s.model,
            batch=s.batch,
            image_size=s.image_size,
            warmup=s.warmup,
            steps=s.steps,
            lr=0.001 if s.model == "vgg16" else 0.01,
        )
        Plan(impl="same-ddp", nproc=n, threads=max(1, cpu_cores() // n), out=str(out), cases=[case]).dump(plan_file)
        done = self.launched(
            "ddp",
            [
                "-m",
                "benchmarks.same_process",
                "--backend",
                "ddp",
                "--blocks",
                str(s.blocks),
                "--plan",
                str(plan_file),
                *extra,
            ],
            cap=240,
            log_name=f"throughput-{precision}",
        )
        reports = self._reports(out, "same-ddp.*.rank*.json", n, done)
        entry = stats.same_process(reports)
        px_s, plain_s = entry["median_step_s"], entry["baseline_median_step_s"]
        figures = {
            "parallelx_ms": px_s * 1e3,
            "plain_ms": plain_s * 1e3,
            "ratio": entry["ratio"],
            "ci95": entry["ci95"],
            "parallelx_images_per_s": n * s.batch / px_s,
            "plain_images_per_s": n * s.batch / plain_s,
            "blocks_parallelx_faster": f"{sum(r < 1 for r in entry['per_round'])}/{s.blocks}",
            "device": reports[0]["device"],
        }
        verdict = ("within" if entry["ratio"] <= stats.RATIO_TARGET else "ABOVE") + f" the {stats.RATIO_TARGET} target"
        building = self.horovod_build is not None and self.horovod_build.poll() is None
        note = "; measured while Horovod was building in the background (at low priority)" if building else ""
        return Outcome(
            f"parallelx / plain DDP median step time {entry['ratio']:.3f} ({verdict}; not a pass "
            f"criterion), {n * s.batch / px_s:.0f} images/s{note}",
            figures,
        )

    def _reports(self, out: Path, pattern: str, n: int, done: Any) -> list[dict[str, Any]]:
        """Every rank's report in ``out``; fewer than ``n`` fails the step."""
        reports = [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]
        if len(reports) != n:
            raise Fail(f"expected {n} rank report(s) in {out}, found {len(reports)}", log=done.output)
        return reports

    # ------------------------------------------------------------ fsdp
    def fsdp(self) -> None:
        """FSDP2 on the check's process group (NCCL on GPUs), each precision the device has, and
        what each rank holds against ddp (``benchmarks.memory``)."""
        for precision in ("bf16-mixed", "16-mixed"):
            name = f"fsdp against ddp, {precision}: memory per rank"
            if precision == "16-mixed" and not self.cuda:
                self.skip("fsdp", name, "CUDA only: float16 with loss scaling needs a GPU", needs="cuda")
            else:
                self.step("fsdp", name, lambda p=precision: self._fsdp(p), need_s=60)
        self.step(
            "fsdp",
            "sharded checkpoint in the background: the copies written, loaded exactly",
            self._sharded_async,
            need_s=60,
        )

    def _sharded_async(self) -> Outcome:
        """fsdp's sharded checkpoint saved with ``asynchronous=True``: each rank's shards copied (into pinned
        memory on a GPU), DCP's write on the writer thread over a Gloo group beside the training's NCCL one,
        held until the training has stepped on; a fresh run loads exactly what was saved
        (``tests/support/zero_shards_worker.py``, as tests/launcher/test_zero_shards.py runs it on the CPU)."""
        import torch

        out = self.work / "sharded-async"
        worker = str(ROOT / "tests" / "support" / "zero_shards_worker.py")
        args = ["--backend", "fsdp", "--fsdp-sharded-checkpoints", "--asynchronous", "--out", str(out)]
        self.launched("fsdp", [worker, *args], cap=self.settings.launch_timeout_s, log_name="sharded-async")
        r = torch.load(out / "result.pt", weights_only=True)

        def worst(a: Any, b: Any) -> float:
            if isinstance(a, dict):
                return max((worst(a[k], b[k]) for k in a), default=0.0)
            return float((a.double() - b.double()).abs().max()) if torch.is_tensor(a) and a.numel() else 0.0

        figures = {
            "loaded_vs_saved": max(worst(r["loaded"][k], r["saved"][k]) for k in ("model", "optimizer")),
            "resumed_vs_uninterrupted": worst(r["B"], r["A"]),
            "writer_threads": r["writer_threads"],
        }
        if r["writer_threads"] != ["parallelx-checkpoint"]:
            raise Fail(f"the shards were written on {r['writer_threads']}, not the writer thread", figures=figures)
        if figures["loaded_vs_saved"] != 0.0:
            raise Fail(f"the loaded state differs from the saved by {figures['loaded_vs_saved']:.3g}", figures=figures)
        return Outcome(
            f"{r['world_size']} process(es): the writer thread wrote the copies after the next steps; loaded == saved "
            f"exactly; the resumed run against the uninterrupted one: {figures['resumed_vs_uninterrupted']:.3g}",
            figures,
        )

    def _fsdp(self, precision: str) -> Outcome:
        model, size, batch = ("vgg16", 224, 8) if self.cuda else ("lenet", 32, 4)
        rows = {}
        for backend in ("ddp", "fsdp"):
            out = self.work / f"memory-{backend}-{precision}.json"
            self.launched(
                backend,
                [
                    "-m",
                    "benchmarks.memory",
                    "--worker",
                    "--backend",
                    backend,
                    "--model",
                    model,
                    "--batch",
                    str(batch),
                    "--image-size",
                    str(size),
                    "--steps",
                    "2",
                    "--precision",
                    precision,
                    "--out",
                    str(out),
                ],
                cap=self.settings.launch_timeout_s,
                log_name=f"memory-{backend}-{precision}",
            )
            rows[backend] = json.loads(out.read_text())
        held = {b: max(r["model_state"] for r in rs) for b, rs in rows.items()}
        ratio = held["fsdp"] / held["ddp"]
        comm, want = rows["fsdp"][0]["comm"], "nccl" if self.cuda else "gloo"
        figures = {
            "fsdp_model_state_mib": held["fsdp"] / 2**20,
            "ddp_model_state_mib": held["ddp"] / 2**20,
            "ratio": ratio,
            "fsdp_peak_mib": max(r["peak"] for r in rows["fsdp"]) / 2**20,
            "step_time_vs_ddp": rows["fsdp"][0]["step_s"] / rows["ddp"][0]["step_s"],
            "comm": comm,
        }
        if comm != want:
            raise Fail(f"fsdp's process group is {comm}, expected {want}", figures=figures)
        if self.nproc > 1 and ratio > 0.6:
            raise Fail(
                f"fsdp holds {ratio:.2f} of ddp's model state per rank at {self.nproc} processes "
                "(expected at most 0.6)",
                figures=figures,
            )
        return Outcome(
            f"{model} over {comm}, {self.nproc} process(es): fsdp holds {ratio:.2f} of ddp's model "
            f"state per rank ({held['fsdp'] / 2**20:.0f} of {held['ddp'] / 2**20:.0f} MiB)",
            figures,
        )

    # ------------------------------------------------------------ transformers

    def transformers(self) -> None:
        """The GPT recipe compiled, recomputing its blocks and offloading to the CPU, each against its twin."""
        for backend, options in GPT_CASES.items():
            for option in options:
                name = " ".join(["gpt on", backend, *GPT_BACKEND_ARGS.get(backend, ()), *option])
                if option == TENSOR_PARALLEL and (self.nproc < 2 or self.nproc % 2):
                    self.skip(
                        "transformers",
                        name,
                        f"tensor parallel 2 needs an even number of GPUs, at least 2; this machine shows {self.nproc} "
                        "(tests/launcher/test_tensor_parallel.py runs it on the CPU)",
                        needs="2 GPUs",
                    )
                elif not self.cuda and option in (COMPILE, OFFLOAD):
                    why = (
                        "inductor writes Triton kernels for the GPU (tests/launcher/test_compile.py compiles on the CPU)"
                        if option == COMPILE
                        else "on the CPU there is nothing to offload to, and the recipe stops saying so"
                    )
                    self.skip("transformers", name, f"CUDA only: {why}", needs="cuda")
                elif option not in self.settings.gpt_cases.get(backend, ()):
                    self.skip(
                        "transformers",
                        name,
                        "dry run: one pair, fsdp with and without activation checkpointing, to keep the dry run "
                        "short (tests/launcher/test_recipe_parity.py runs the GPT under every backend)",
                    )
                else:
                    # Horovod's checks come after this section: while it builds, they keep the end of the budget.
                    need = 30 + (HOROVOD_CHECKS_S if self.horovod_build is not None else 0.0)
                    self.step("transformers", name, lambda b=backend, o=option: self._gpt(b, o), need_s=need)

    def _gpt(self, backend: str, option: tuple[str, ...]) -> Outcome:
        """One GPT run: it exits 0 with a finite val loss; with an option, within ``gpt_rtol`` of its twin's."""
        s = self.settings
        out = self.work / "runs" / "-".join(["gpt", backend, *(o.lstrip("-") for o in option)])
        shutil.rmtree(out, ignore_errors=True)
        done = self.launched(backend, gpt_target(backend, option, s, out), cap=s.launch_timeout_s, log_name=out.name)
        if not (out / "metrics.json").is_file():
            raise Fail(f"exited 0 but wrote no {out / 'metrics.json'}", log=done.output)
        metrics = json.loads((out / "metrics.json").read_text())
        loss = metrics["final_val_loss"]
        figures = {"val_loss": loss, "tokens_per_s": metrics.get("train_tokens_per_s"), "launch_s": done.seconds}
        if metrics.get("backend") != backend or metrics.get("world_size") != self.nproc or not math.isfinite(loss):
            raise Fail(
                f"metrics.json says backend {metrics.get('backend')!r}, world size {metrics.get('world_size')}, "
                f"val loss {loss}; expected {backend!r}, {self.nproc} and a finite loss",
                log=done.output,
                figures=figures,
            )
        how = f"{self.nproc} processes on the {'GPU' if self.cuda else 'CPU'}, val loss {loss:.4f}"
        if not option:
            self.gpt_losses[backend] = loss
            return Outcome(how, figures)
        if (twin := self.gpt_losses.get(backend)) is None:
            return Outcome(f"{how}; the run without {' '.join(option)} did not pass: no twin to compare with", figures)
        rel = abs(loss - twin) / abs(twin)
        figures.update(twin_val_loss=twin, rel_diff=rel)
        if rel > s.gpt_rtol:
            raise Fail(
                f"val loss {loss:.6g}, the run without {' '.join(option)} {twin:.6g}: {rel:.1e} apart "
                f"(relative tolerance {s.gpt_rtol:g})",
                log=done.output,
                figures=figures,
            )
        same = "to the bit" if rel == 0 else f"within {rel:.1e} (tolerance {s.gpt_rtol:g})"
        return Outcome(f"{how}, {same} of the run without {' '.join(option)}", figures)

    # ------------------------------------------------------------ host-sync

    def host_sync(self, backends: Sequence[str]) -> None:
        for backend in (b for b in backends if b in self.settings.sync_backends):
            self.step("host-sync", f"training loop on {backend}", lambda b=backend: self._host_sync(b), need_s=35)
            if not self.cuda:
                self.skip(
                    "host-sync",
                    f"synchronisations per step on {backend}",
                    "CUDA only: torch.cuda.set_sync_debug_mode counts them on a GPU",
                    needs="cuda",
                )

    def _host_sync(self, backend: str) -> Outcome:
        """The recipes' training loop (``workers.sync_worker``) under the backend's launcher: step times, and
        synchronisations with the host per step (CUDA only), against the plain framework's loop."""
        import parallelx

        s = self.settings
        n = self.nproc if parallelx.describe(backend).launcher.multi_process else 1
        out, plan_file = self.work / f"sync-{backend}", self.work / f"sync-{backend}.json"
        shutil.rmtree(out, ignore_errors=True)
        warmup, short, long = s.sync_steps
        plan_file.write_text(
            json.dumps(
                {
                    "backend": backend,
                    "nproc": n,
                    "batch": s.sync_batch,
                    "warmup": warmup,
                    "short": short,
                    "long": long,
                    "workers": s.sync_workers,
                    "out": str(out),
                }
            )
        )
        done = self.launched(
            backend, [str(ENTRY), "--worker", "sync", "--plan", str(plan_file)], cap=150, log_name=f"sync-{backend}"
        )
        reports = self._reports(out, "sync.rank*.json", n, done)
        px, plain = reports[0]["loops"]["parallelx"], reports[0]["loops"].get("plain")  # the main rank's
        figures: dict[str, Any] = {"parallelx_step_ms": px["step_s"] * 1e3}
        text = f"parallelx loop {px['step_s'] * 1e3:.2f} ms/step"
        if plain is not None:
            figures.update(plain_step_ms=plain["step_s"] * 1e3, step_ratio=px["step_s"] / plain["step_s"])
            text += f", plain {plain['step_s'] * 1e3:.2f} ms/step (ratio {figures['step_ratio']:.3f})"
        else:
            text += " (no plain loop for this backend)"
        text += f"; LeNet, {s.sync_batch}/process, {s.sync_steps[2] - s.sync_steps[1]} steps timed"
        if px["syncs_per_step"] is None:
            return Outcome(text + "; syncs not counted on the CPU", figures)
        item = sync_item(backend, reports)  # the CUDA-only half: one more item from the same launch
        item.log = done.output if item.status == FAILED else None
        self.record(item)
        return Outcome(text, figures)


def gpt_target(backend: str, option: tuple[str, ...], settings: Settings, out: Path) -> list[str]:
    """The transformers section's GPT launch: one epoch cut to ``--max-steps``, with no sample at the end
    (generating is a forward per character, each a collective under fsdp and ZeRO-3)."""
    return [
        *("-m", "parallelx.recipes.gpt", "--backend", backend, *GPT_BACKEND_ARGS.get(backend, ())),
        *("--out-dir", str(out), "--epochs", "1", "--warmup-steps", "2", "--sample-tokens", "0"),
        *settings.gpt_args,
        *option,
    ]


def sync_item(backend: str, reports: Sequence[dict[str, Any]]) -> Item:
    """The verdict on the synchronisations counted per training step: the
    main rank's (whose progress bar reads the loss) parallelx loop may exceed
    the plain framework's own loop by less than :data:`SYNC_EXCESS_LIMIT` (a
    framework that synchronises every step by itself is not parallelx's doing)."""
    loops = reports[0]["loops"]
    px = loops["parallelx"]["syncs_per_step"]
    plain = loops["plain"]["syncs_per_step"] if "plain" in loops else None
    figures = {
        "parallelx_syncs_per_step": px,
        "plain_syncs_per_step": plain,
        "other_ranks_max": max((r["loops"]["parallelx"]["syncs_per_step"] for r in reports[1:]), default=None),
    }
    detail = (
        f"parallelx's loop {px:.2f} syncs/step on the main rank, "
        f"{'no plain loop' if plain is None else f'plain {plain:.2f}'}; expected about 0.1 (the progress "
        f"bar reads the loss every 10th step) and less than {SYNC_EXCESS_LIMIT} above the plain loop"
    )
    ok = px - (plain or 0.0) < SYNC_EXCESS_LIMIT
    if not ok:
        detail += ": something in parallelx's step or loop waits for the GPU (.item(), .cpu(), bool() of a tensor)"
    return Item(
        "host-sync", f"synchronisations per step on {backend}", PASSED if ok else FAILED, detail, figures, needs="cuda"
    )


def _first_line(cmd: list[str], containing: str = "") -> str | None:
    """The first output line of ``cmd`` (holding ``containing``), or None when it cannot run."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in res.stdout.splitlines() if ln.strip() and containing in ln] if res.returncode == 0 else []
    return lines[0].strip() if lines else None


def install_wheels(wheels: Path, site: Path) -> Item:
    """The carried wheels into ``site`` (``pip install --no-index --no-deps --target``), then first on the path
    of this process and of every process it starts: the GPU machine's python3 is itself a venv, so a
    ``--system-site-packages`` venv made from it would not see its torch.  Run before torch is imported (the
    wheels bring a newer typing-extensions)."""
    found, start, site = sorted(wheels.glob("*.whl")), time.monotonic(), site.resolve()
    item = Item(
        "install", "carried wheels", PASSED, f"{len(found)} wheels into {site} (pip --no-index --no-deps --target)"
    )
    if not found:
        item.status, item.detail = (
            FAILED,
            (
                f"no wheels in {wheels}/: run `.venv/bin/python scripts/gpu_wheels.py` "
                "on a networked machine and carry the folder"
            ),
        )
    else:
        shutil.rmtree(site, ignore_errors=True)
        try:
            res = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--no-index",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "--target",
                    str(site),
                    *map(str, found),
                ],
                capture_output=True,
                text=True,
                timeout=180,
                check=False,
            )
            if res.returncode != 0:
                item.status, item.detail, item.log = (
                    FAILED,
                    f"pip exited with status {res.returncode}",
                    res.stdout + res.stderr,
                )
        except subprocess.TimeoutExpired:
            item.status, item.detail = FAILED, "pip timed out after 180s"
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    os.environ["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])  # the launchers
    item.seconds = time.monotonic() - start
    return item


def kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
