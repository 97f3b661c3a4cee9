"""The host-sync section: the recipes' training loop, run by
:mod:`gpu_check.sync_worker` under each backend's launcher; synchronisations
with the host per step (CUDA only) and step times, against the plain
framework's loop."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from typing import Any

from ..check import Fail, Outcome, Skip
from ..launching import unavailable
from ..report import FAILED, PASSED, Item
from ..settings import ENTRY, SYNC_EXCESS_LIMIT
from .base import Steps


class HostSyncSteps(Steps):
    def host_sync(self, backends: Sequence[str]) -> None:
        for backend in backends:
            if backend not in self.settings.sync_backends:
                continue
            self.step("host-sync", f"training loop on {backend}", lambda b=backend: self._host_sync(b), need_s=35)
            if not self.cuda:
                self.skip("host-sync", f"synchronisations per step on {backend}",
                          "CUDA only: torch.cuda.set_sync_debug_mode counts them on a GPU", needs="cuda")

    def _host_sync(self, backend: str) -> Outcome:
        if (why := unavailable(backend)) is not None:
            raise Skip(why)
        import parallelx

        s, n = self.settings, self.n_for(backend)
        out = self.work / f"sync-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        plan = {"backend": backend, "nproc": n, "batch": s.sync_batch, "warmup": s.sync_steps[0],
                "short": s.sync_steps[1], "long": s.sync_steps[2], "workers": s.sync_workers, "out": str(out)}
        plan_file = self.work / f"sync-{backend}.json"
        plan_file.write_text(json.dumps(plan))
        res = self.runner.launch(backend, [str(ENTRY), "--worker", "sync", "--plan", str(plan_file)],
                                 n, timeout_s=self.timeout(150), log_name=f"sync-{backend}")
        if res.error():
            raise Fail(f"{parallelx.backend_class(backend).launcher.name} {res.error()}", log=res.output())
        reports = [json.loads(p.read_text()) for p in sorted(out.glob("sync.rank*.json"))]
        if len(reports) != n:
            raise Fail(f"expected {n} rank report(s) in {out}, found {len(reports)}", log=res.output())
        main = reports[0]  # the main rank shows the progress bar, the one reading the loss
        px, plain = main["loops"]["parallelx"], main["loops"].get("plain")
        figures: dict[str, Any] = {"parallelx_step_ms": px["step_s"] * 1e3}
        text = f"parallelx loop {px['step_s'] * 1e3:.2f} ms/step"
        if plain is not None:
            figures["plain_step_ms"] = plain["step_s"] * 1e3
            figures["step_ratio"] = px["step_s"] / plain["step_s"]
            text += f", plain {plain['step_s'] * 1e3:.2f} ms/step (ratio {figures['step_ratio']:.3f})"
        else:
            text += " (no plain loop for this backend)"
        text += f"; LeNet, {s.sync_batch}/process, {s.sync_steps[2] - s.sync_steps[1]} steps timed"
        if px["syncs_per_step"] is None:
            return Outcome(text + "; syncs not counted on the CPU", figures)
        # The CUDA-only half: one more item from the same launch.
        item = sync_item(backend, reports)
        item.log = res.output() if item.status == FAILED else None
        self.record(item)
        return Outcome(text, figures)


def sync_item(backend: str, reports: Sequence[dict[str, Any]]) -> Item:
    """The verdict on the synchronisations counted per training step: the
    main rank's (the one whose progress bar reads the loss) parallelx loop
    may exceed the plain framework's own loop by less than
    :data:`SYNC_EXCESS_LIMIT` (a framework that synchronises every step by
    itself is not parallelx's doing)."""
    loops = reports[0]["loops"]
    px = loops["parallelx"]["syncs_per_step"]
    plain = loops["plain"]["syncs_per_step"] if "plain" in loops else None
    excess = px - (plain or 0.0)
    figures = {"parallelx_syncs_per_step": px, "plain_syncs_per_step": plain,
               "other_ranks_max": max((r["loops"]["parallelx"]["syncs_per_step"] for r in reports[1:]), default=None)}
    plain_txt = "no plain loop" if plain is None else f"plain {plain:.2f}"
    detail = (f"parallelx's loop {px:.2f} syncs/step on the main rank, {plain_txt}; expected about 0.1 (the progress "
              f"bar reads the loss every 10th step) and less than {SYNC_EXCESS_LIMIT} above the plain loop")
    if excess >= SYNC_EXCESS_LIMIT:
        detail += ": something in parallelx's step or loop waits for the GPU (.item(), .cpu(), bool() of a tensor)"
    status = PASSED if excess < SYNC_EXCESS_LIMIT else FAILED
    return Item("host-sync", f"synchronisations per step on {backend}", status, detail, figures, needs="cuda")
