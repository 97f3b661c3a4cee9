"""One rank of the host-sync check, started by the host-sync section under
the backend's launcher as ``scripts/gpu_check.py --worker sync --plan FILE``."""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def count_syncs(device: Any) -> Iterator[list[int]]:
    """Count the synchronising CUDA calls made inside the block (on the CPU:
    nothing to count, the list stays empty).  ``set_sync_debug_mode("warn")``
    makes every such call issue a warning; all of them are recorded."""
    import torch

    found: list[int] = []
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.append(sum("synchronizing CUDA operation" in str(w.message) for w in caught))


def sync_worker(plan_file: Path) -> int:
    """One rank of the host-sync check, under its backend's launcher: the
    recipes' loop (``run_epoch``) and the plain framework's loop on the same
    loader, each run for a short and a long number of steps; the differences
    give per-step figures free of set-up and end-of-pass costs."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks import px_worker, same_process, workload
    from parallelx.recipes.engine import run_epoch

    p = json.loads(plan_file.read_text())
    case = workload.Case(model="lenet", batch=p["batch"], image_size=32, warmup=0, steps=1, lr=0.01)
    plan = workload.Plan(impl=f"sync-{p['backend']}", nproc=p["nproc"],
                         threads=max(1, workload.cpu_cores() // p["nproc"]), out=p["out"], cases=[case])
    with px_worker.make_backend(p["backend"], plan) as backend:
        workload.check_world_size(plan, backend.world_size)
        device = backend.device
        steps = p["warmup"] + p["long"] + 1
        g = torch.Generator().manual_seed(0)
        n = case.batch * backend.world_size * steps
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        loader = DataLoader(data, batch_size=case.batch, sampler=backend.make_sampler(data, shuffle=True, seed=0),
                            num_workers=p["workers"], pin_memory=device.type == "cuda",
                            persistent_workers=p["workers"] > 0)
        base = workload.build_model(case)
        model, optimizer = backend.setup(base, workload.make_optimizer(base, case))
        criterion = nn.CrossEntropyLoss(reduction="none")

        def px_loop(k: int) -> None:
            run_epoch(backend, model, loader, criterion, optimizer=optimizer, max_steps=k)

        loops: dict[str, Callable[[int], None]] = {"parallelx": px_loop}
        plain = same_process.PLAIN.get(p["backend"])
        if plain is not None:
            plain_step, _ = plain(case, backend)

            def plain_loop(k: int) -> None:
                # The plain script's loop: the same loader, the same copies to the device.
                for i, (x, y) in enumerate(loader):
                    if i >= k:
                        break
                    plain_step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))

            loops["plain"] = plain_loop
        result: dict[str, Any] = {}
        for name, loop in loops.items():
            loop(p["warmup"])
            runs = {}
            for k in (p["short"], p["long"]):
                workload.synchronize(device)
                start = time.perf_counter()
                with count_syncs(device) as found:
                    loop(k)
                workload.synchronize(device)  # outside the count: it is ours, not the loop's
                runs[k] = {"seconds": time.perf_counter() - start, "syncs": found[0] if found else None}
            short, long = runs[p["short"]], runs[p["long"]]
            k = p["long"] - p["short"]
            result[name] = {"runs": runs, "step_s": (long["seconds"] - short["seconds"]) / k,
                            "syncs_per_step": None if long["syncs"] is None else (long["syncs"] - short["syncs"]) / k}
        out = Path(p["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"sync.rank{backend.rank}.json").write_text(json.dumps(
            {"rank": backend.rank, "world_size": backend.world_size, "device": str(device), "loops": result}))
    return 0
