"""Build Horovod 0.28.1 against the installed PyTorch, and cache the wheel.

Horovod's last release (0.28.1, 2023) no longer builds against current PyTorch
as released.  Three small source changes make it build:

1. and 2. ``CMakeLists.txt`` and ``horovod/torch/CMakeLists.txt`` pin
   ``CMAKE_CXX_STANDARD 14``; PyTorch >= 2.10 headers refuse anything below
   C++20 (``#error C++20 or later compatible compiler is required``).
3. ``cmake/Modules/FindPytorch.cmake`` marks the build as CUDA whenever torch
   is a CUDA build and a CUDA toolkit is installed, then fails looking for
   cudart on machines without a GPU.  For a CPU build we force it off.

One more change is for time, not correctness: Horovod always builds as CMake's
``RelWithDebInfo`` (``-O3 -g``), and the debug information of every unit that
includes PyTorch's headers is most of the compiler's work.  We drop ``-g``
(the code is still ``-O3``); set ``PARALLELX_HOROVOD_DEBUG_INFO=1`` to keep it.

The built wheel is cached under ``$PARALLELX_CACHE`` (default
``~/.cache/parallelx``), keyed by Horovod, torch and Python versions and the
CPU/GPU flavour, so that a second set-up on the same machine takes seconds.

Usage::

    python scripts/build_horovod.py            # install (build once, then cached)
    python scripts/build_horovod.py --rebuild  # ignore the cache
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HOROVOD_VERSION = "0.28.1"


def log(msg: str) -> None:
    print(f"[build_horovod] {msg}", flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def gpu_build_wanted() -> bool:
    """A GPU (NCCL) build only where a GPU and the CUDA toolkit are present."""
    if os.environ.get("PARALLELX_HOROVOD_GPU") is not None:
        return os.environ["PARALLELX_HOROVOD_GPU"] == "1"
    import torch

    return torch.cuda.is_available() and shutil.which("nvcc") is not None


def patch(path: Path, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in ``path``; fail loudly if ``old`` is absent,
    so a changed upstream file is noticed instead of silently mis-built."""
    text = path.read_text()
    if old not in text:
        raise SystemExit(f"patch failed: {old!r} not found in {path}")
    path.write_text(text.replace(old, new))


def patch_source(src: Path, gpu: bool) -> None:
    patch(src / "CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 20)")
    patch(src / "horovod/torch/CMakeLists.txt", "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 20)")
    if not gpu:
        anchor = 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)'
        patch(
            src / "cmake/Modules/FindPytorch.cmake",
            anchor,
            anchor + "\n# parallelx: CPU-only build, never link cudart\nset(Pytorch_CUDA FALSE)",
        )


def drop_debug_info(src: Path) -> None:
    anchor = 'string(REPLACE "-O2" "-O3" CMAKE_CXX_FLAGS_RELWITHDEBINFO "${CMAKE_CXX_FLAGS_RELWITHDEBINFO}")'
    patch(
        src / "CMakeLists.txt",
        anchor,
        anchor
        + "\n# parallelx: no debug information (most of the build's time)"
        + '\nstring(REPLACE "-g" "" CMAKE_C_FLAGS_RELWITHDEBINFO "${CMAKE_C_FLAGS_RELWITHDEBINFO}")'
        + '\nstring(REPLACE "-g" "" CMAKE_CXX_FLAGS_RELWITHDEBINFO "${CMAKE_CXX_FLAGS_RELWITHDEBINFO}")',
    )


def cache_dir(gpu: bool) -> Path:
    import torch

    root = Path(os.environ.get("PARALLELX_CACHE", Path.home() / ".cache" / "parallelx"))
    torch_v = torch.__version__.split("+")[0]
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return root / "wheels" / f"horovod-{HOROVOD_VERSION}-torch{torch_v}-{py}-{'gpu' if gpu else 'cpu'}"


def build(dest: Path, gpu: bool) -> Path:
    with tempfile.TemporaryDirectory(prefix="hvd-build-") as tmp:
        tmp_path = Path(tmp)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"horovod=={HOROVOD_VERSION}",
                "-d",
                str(tmp_path),
            ]
        )
        sdist = next(tmp_path.glob("horovod-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp_path, filter="data")
        src = tmp_path / f"horovod-{HOROVOD_VERSION}"
        patch_source(src, gpu)
        if os.environ.get("PARALLELX_HOROVOD_DEBUG_INFO") != "1":
            drop_debug_info(src)
        env = dict(os.environ)
        env.update(
            HOROVOD_WITH_PYTORCH="1",
            HOROVOD_WITH_GLOO="1",
            HOROVOD_WITHOUT_MPI="1",
            HOROVOD_WITHOUT_TENSORFLOW="1",
            HOROVOD_WITHOUT_MXNET="1",
            MAKEFLAGS=env.get("MAKEFLAGS", f"-j{os.cpu_count() or 2}"),
        )
        # CMake 4 refuses the bundled gloo's cmake_minimum_required(2.8.12) unless told
        # the oldest policy version to emulate; CMake 3 ignores the variable.
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        if gpu:
            env.setdefault("HOROVOD_GPU_OPERATIONS", "NCCL")
        wheel_dir = tmp_path / "wheel"
        # --no-build-isolation: Horovod's build imports the torch it builds against.
        run(
            [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", str(src), "-w", str(wheel_dir)],
            env=env,
        )
        wheel = next(wheel_dir.glob("horovod-*.whl"))
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / wheel.name
        # Copy then rename, so an interrupted build never leaves a half wheel in the cache.
        shutil.copy(wheel, final.with_suffix(".part"))
        os.replace(final.with_suffix(".part"), final)
        return final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="ignore the cached wheel")
    args = parser.parse_args()

    gpu = gpu_build_wanted()
    dest = cache_dir(gpu)
    wheels = sorted(dest.glob("horovod-*.whl")) if dest.exists() else []
    if wheels and not args.rebuild:
        wheel = wheels[-1]
        log(f"using cached wheel {wheel}")
    else:
        log(
            f"building Horovod {HOROVOD_VERSION} ({'GPU/NCCL' if gpu else 'CPU/Gloo'}); about 2.5 minutes on 2 idle cores"
        )
        wheel = build(dest, gpu)
        log(f"cached {wheel}")
    # Horovod's own runtime deps (cloudpickle, psutil, pyyaml, ...) come from the index.
    run([sys.executable, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)])
    run([sys.executable, "-m", "pip", "install", "cloudpickle", "psutil", "pyyaml", "packaging", "cffi"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
