"""Horovod built from its sdist with NCCL operations, in the background
process the install section starts as ``scripts/gpu_check.py --build-horovod
SDIST --wheel-dir DIR``."""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from .launching import nccl_dirs


def horovod_source(sdist: Path, into: Path) -> Path:
    """Horovod's sources from ``sdist`` under ``into``, patched for a GPU build."""
    import build_horovod as bh  # scripts/build_horovod.py: the entry script's folder is on sys.path

    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    src = into / f"horovod-{bh.HOROVOD_VERSION}"
    bh.patch_source(src, gpu=True)
    # CUDA 13's headers (CCCL) refuse anything below C++17; Horovod pins its CUDA kernels to C++11.
    bh.patch(src / "horovod/common/ops/cuda/CMakeLists.txt", "set(CMAKE_CUDA_STANDARD 11)",
             "set(CMAKE_CUDA_STANDARD 17)")
    # The driver's unversioned libcuda.so is a development link that driver-only machines
    # (containers) often lack; libcuda.so.1, its soname, is always there (torch loads it).
    bh.patch(src / "horovod/torch/cuda_util.cc", 'dlopen("libcuda.so", RTLD_LAZY)', 'dlopen("libcuda.so.1", RTLD_LAZY)')
    return src


def build_horovod(sdist: Path, wheel_dir: Path) -> int:
    """Build Horovod from the carried sdist with NCCL operations: the patches
    of ``scripts/build_horovod.py`` (C++20 for current torch), plus what the
    GPU machine's CUDA 13 needs, and NCCL from torch's own wheel."""
    import torch

    import build_horovod as bh  # scripts/build_horovod.py: the entry script's folder is on sys.path

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hvd-gpu-") as tmp:
        tmp_path = Path(tmp)
        src = horovod_source(sdist, tmp_path)
        env = dict(os.environ)
        # As scripts/build_horovod.py builds it, with NCCL operations on top.
        env.update(HOROVOD_WITH_PYTORCH="1", HOROVOD_WITH_GLOO="1", HOROVOD_WITHOUT_MPI="1",
                   HOROVOD_WITHOUT_TENSORFLOW="1", HOROVOD_WITHOUT_MXNET="1", HOROVOD_GPU_OPERATIONS="NCCL",
                   MAKEFLAGS=env.get("MAKEFLAGS", f"-j{max(2, (os.cpu_count() or 4) - 2)}"))
        # The bundled gloo and flatbuffers ask for CMake 2.8.12, which CMake 4 (pip's cmake there
        # may be one) refuses unless told the oldest policies it must emulate; older CMakes ignore this.
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        # Only this GPU's architecture: Horovod otherwise builds every one nvcc knows (slow, and
        # CUDA 13 no longer knows some of Horovod's defaults).
        major, minor = torch.cuda.get_device_capability(0)
        env.setdefault("HOROVOD_BUILD_CUDA_CC_LIST", f"{major}{minor}")
        nvcc = shutil.which("nvcc")
        if nvcc is not None:
            env.setdefault("HOROVOD_CUDA_HOME", str(Path(nvcc).resolve().parents[1]))
        nccl = nccl_dirs()
        if nccl is not None:
            # torch's wheel ships libnccl.so.2 only: CMake's find_library wants libnccl.so.
            links = tmp_path / "nccl-lib"
            links.mkdir()
            lib = sorted(nccl[1].glob("libnccl.so*"))[0]
            (links / "libnccl.so").symlink_to(lib)
            env.update(HOROVOD_NCCL_INCLUDE=str(nccl[0]), HOROVOD_NCCL_LIB=str(links), HOROVOD_NCCL_LINK="SHARED")
        bh.log(f"building with CC list {env['HOROVOD_BUILD_CUDA_CC_LIST']}, CUDA at {env.get('HOROVOD_CUDA_HOME')}, "
               f"NCCL {nccl}")
        bh.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                str(src), "-w", str(wheel_dir)], env=env)
    bh.log(f"built in {time.monotonic() - started:.0f}s")
    return 0
