"""What runs in the processes the GPU check starts through ``scripts/gpu_check.py``:
one rank of the host-sync check (``--worker sync --plan FILE``, under the
backend's launcher) and the Horovod build (``--build-horovod SDIST --wheel-dir DIR``)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def count_syncs(device: Any) -> Iterator[list[int]]:
    """Count the synchronising CUDA calls made inside the block (on the CPU
    the list stays empty): ``set_sync_debug_mode("warn")`` makes each one warn."""
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
    """The recipes' training loop (as ``recipes/cifar10.py`` writes it) and the
    plain framework's loop on the same loader, each run for a short and a long
    number of steps: the differences give per-step figures free of set-up and
    end-of-pass costs."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import parallelx
    from benchmarks import plain, px_worker, workload

    p = json.loads(plan_file.read_text())
    case = workload.Case(model="lenet", batch=p["batch"], image_size=32, warmup=0, steps=1, lr=0.01)
    plan = workload.Plan(
        impl=f"sync-{p['backend']}",
        nproc=p["nproc"],
        threads=max(1, workload.cpu_cores() // p["nproc"]),
        out=p["out"],
        cases=[case],
    )
    with px_worker.make_backend(p["backend"], plan) as backend:
        workload.check_world_size(plan, backend.world_size)
        device = backend.device
        n = case.batch * backend.world_size * (p["warmup"] + p["long"] + 1)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        loader = DataLoader(
            data,
            batch_size=case.batch,
            sampler=backend.make_sampler(data, shuffle=True, seed=0),
            num_workers=p["workers"],
            pin_memory=device.type == "cuda",
            persistent_workers=p["workers"] > 0,
        )
        base = workload.build_model(case)
        model, optimizer = backend.setup(base, workload.make_optimizer(base, case))
        criterion = nn.CrossEntropyLoss(reduction="none")

        def recipe_loop(k: int) -> None:
            # The recipes' step: backend.batches, autocast, backward, step, the metric sums, a global figure.
            model.train()
            sums = parallelx.MetricSums(loader.sampler)
            for i, (x, y) in enumerate(backend.batches(loader, limit=k)):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with backend.autocast():
                    out = model(x)
                    losses = criterion(out, y)
                backend.backward(losses.mean())
                backend.step(optimizer)
                sums.update(losses, out.argmax(1) == y)
                if backend.is_main() and i % 10 == 0:  # the progress bar's loss, as the recipes show it
                    losses.mean().item()
            sums.compute(backend)

        loops: dict[str, Callable[[int], None]] = {"parallelx": recipe_loop}
        if p["backend"] in plain.FRAMEWORKS:
            world = plain.World(backend.rank, backend.local_rank, backend.world_size, device)
            plain_step, _ = plain.FRAMEWORKS[p["backend"]][1](case, world)

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
            short, long, k = runs[p["short"]], runs[p["long"]], p["long"] - p["short"]
            result[name] = {
                "runs": runs,
                "step_s": (long["seconds"] - short["seconds"]) / k,
                "syncs_per_step": None if long["syncs"] is None else (long["syncs"] - short["syncs"]) / k,
            }
        Path(p["out"]).mkdir(parents=True, exist_ok=True)
        (Path(p["out"]) / f"sync.rank{backend.rank}.json").write_text(
            json.dumps({"rank": backend.rank, "world_size": backend.world_size, "device": str(device), "loops": result})
        )
    return 0


def nccl_dirs() -> tuple[Path, Path] | None:
    """(include, lib) of the NCCL that torch's wheel brings (``nvidia-nccl-*``), if any."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0])
    if (base / "include" / "nccl.h").is_file() and any((base / "lib").glob("libnccl.so*")):
        return base / "include", base / "lib"
    return None


def build_horovod(sdist: Path, wheel_dir: Path) -> int:
    """``scripts/build_horovod.py``'s build with NCCL operations (its ``build(gpu=True)``), offline from the
    carried sdist, which gets first what the GPU machine's CUDA 13 needs; NCCL comes from torch's own wheel."""
    import build_horovod as bh  # scripts/build_horovod.py: the entry script's folder is on sys.path
    import torch

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvd-gpu-") as tmp:
        tmp_path = Path(tmp)
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path, filter="data")
        src = tmp_path / f"horovod-{bh.HOROVOD_VERSION}"
        # CUDA 13's headers (CCCL) refuse anything below C++17; Horovod pins its CUDA kernels to C++11.
        bh.patch(
            src / "horovod/common/ops/cuda/CMakeLists.txt", "set(CMAKE_CUDA_STANDARD 11)", "set(CMAKE_CUDA_STANDARD 17)"
        )
        # The driver's unversioned libcuda.so is a development link that driver-only machines
        # (containers) often lack; libcuda.so.1, its soname, is always there (torch loads it).
        bh.patch(
            src / "horovod/torch/cuda_util.cc", 'dlopen("libcuda.so", RTLD_LAZY)', 'dlopen("libcuda.so.1", RTLD_LAZY)'
        )
        links = tmp_path / "links"
        links.mkdir()
        with tarfile.open(links / sdist.name, "w:gz", compresslevel=1) as tar:
            tar.add(src, arcname=src.name)
        env = os.environ  # what bh.build passes on to pip and Horovod's build
        # bh.build fetches the sdist with pip: from that folder, and with no isolated build environment to
        # download setuptools into (pip reads PIP_NO_BUILD_ISOLATION=0 as --no-build-isolation).
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links), PIP_NO_BUILD_ISOLATION="0")
        env.setdefault("MAKEFLAGS", f"-j{max(2, (os.cpu_count() or 4) - 2)}")
        # Only this GPU's architecture: Horovod otherwise builds every one nvcc knows (slow, and
        # CUDA 13 no longer knows some of Horovod's defaults).
        major, minor = torch.cuda.get_device_capability(0)
        env.setdefault("HOROVOD_BUILD_CUDA_CC_LIST", f"{major}{minor}")
        if (nvcc := shutil.which("nvcc")) is not None:
            env.setdefault("HOROVOD_CUDA_HOME", str(Path(nvcc).resolve().parents[1]))
        if (nccl := nccl_dirs()) is not None:
            # torch's wheel ships libnccl.so.2 only: CMake's find_library wants libnccl.so.
            (tmp_path / "nccl-lib").mkdir()
            (tmp_path / "nccl-lib" / "libnccl.so").symlink_to(sorted(nccl[1].glob("libnccl.so*"))[0])
            env.update(
                HOROVOD_NCCL_INCLUDE=str(nccl[0]),
                HOROVOD_NCCL_LIB=str(tmp_path / "nccl-lib"),
                HOROVOD_NCCL_LINK="SHARED",
            )
        bh.log(
            f"building with CC list {env['HOROVOD_BUILD_CUDA_CC_LIST']}, CUDA at {env.get('HOROVOD_CUDA_HOME')}, "
            f"NCCL {nccl}"
        )
        bh.build(wheel_dir, gpu=True)
    bh.log(f"built in {time.monotonic() - started:.0f}s")
    return 0
