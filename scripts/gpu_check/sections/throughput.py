"""The throughput section: parallelx's DDP step against the plain DDP
script's in the same processes (``benchmarks/same_process.py``), per precision."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil

from ..check import Fail, Outcome, Skip
from ..launching import unavailable
from ..settings import CUDA, PRECISIONS
from .base import Steps


class ThroughputSteps(Steps):
    def throughput(self) -> None:
        s = self.settings
        for precision, extra in PRECISIONS.items():
            name = f"VGG16 {CUDA.image_size} px, {CUDA.batch}/process, {precision}"
            if extra is None:
                self.skip("throughput", name, precision_missing_reason(precision), needs="cuda")
                continue
            if not self.cuda:
                self.skip("throughput", name, "CUDA only: VGG16 at 224 px is the GPU workload", needs="cuda")
                name = f"same-process harness on the CPU (LeNet, {s.batch}/process, {precision}; numbers mean nothing)"
            self.step("throughput", name, lambda e=extra, p=precision: self._throughput(p, e), need_s=45)

    def _throughput(self, precision: str, extra: tuple[str, ...]) -> Outcome:
        from benchmarks import stats
        from benchmarks.workload import Case, Plan, cpu_cores

        if (why := unavailable("ddp")) is not None:
            raise Skip(why)
        s, n = self.settings, self.nproc
        case = Case(model=s.model, batch=s.batch, image_size=s.image_size, warmup=s.warmup, steps=s.steps,
                    lr=0.001 if s.model == "vgg16" else 0.01)
        out = self.work / f"throughput-{precision}"
        shutil.rmtree(out, ignore_errors=True)
        plan_file = self.work / f"throughput-{precision}.json"
        Plan(impl="same-ddp", nproc=n, threads=max(1, cpu_cores() // n), out=str(out), cases=[case]).dump(plan_file)
        res = self.runner.launch("ddp", ["-m", "benchmarks.same_process", "--backend", "ddp", "--blocks",
                                         str(s.blocks), "--plan", str(plan_file), *extra], n,
                                 timeout_s=self.timeout(240), log_name=f"throughput-{precision}")
        if res.error():
            raise Fail(f"torchrun {res.error()}", log=res.output())
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("same-ddp.*.rank*.json"))]
        if len(reports) != n:
            raise Fail(f"expected {n} rank report(s) in {out}, found {len(reports)}", log=res.output())
        entry = stats.same_process(reports)
        px_s, plain_s = entry["median_step_s"], entry["baseline_median_step_s"]
        faster = sum(r < 1 for r in entry["per_round"])
        figures = {"parallelx_ms": px_s * 1e3, "plain_ms": plain_s * 1e3, "ratio": entry["ratio"],
                   "ci95": entry["ci95"], "parallelx_images_per_s": n * s.batch / px_s,
                   "plain_images_per_s": n * s.batch / plain_s, "blocks_parallelx_faster": f"{faster}/{s.blocks}",
                   "device": reports[0]["device"]}
        building = self.horovod_build is not None and self.horovod_build.poll() is None
        verdict = ("within" if entry["ratio"] <= stats.RATIO_TARGET else "ABOVE") + f" the {stats.RATIO_TARGET} target"
        note = "; measured while Horovod was building in the background (at low priority)" if building else ""
        return Outcome(f"parallelx / plain DDP median step time {entry['ratio']:.3f} ({verdict}; not a pass "
                       f"criterion), {n * s.batch / px_s:.0f} images/s{note}", figures)


def precision_missing_reason(precision: str) -> str:
    if parallelx_offers(precision):
        return (f"parallelx now offers --precision {precision}, but this check does not pass it yet: "
                f"set PRECISIONS[{precision!r}] in scripts/gpu_check/settings.py")
    return (f"the option does not exist yet: parallelx.add_arguments defines no --precision {precision}; "
            "measured here once it does")


def parallelx_offers(precision: str) -> bool:
    """Whether parallelx's command line accepts ``--precision PRECISION``."""
    import parallelx

    parser = argparse.ArgumentParser(add_help=False)
    parallelx.add_arguments(parser)
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            ns, rest = parser.parse_known_args(["--precision", precision])
        except SystemExit:  # the option exists without that choice
            return False
    return not rest and getattr(ns, "precision", None) == precision
