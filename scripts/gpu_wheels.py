"""Make ``gpu-wheels/``: everything the GPU check installs on a machine without network.

    .venv/bin/python scripts/gpu_wheels.py            # about 1 minute; needs PyPI
    .venv/bin/python scripts/gpu_wheels.py --check    # only verify an existing folder

The GPU machine's ``python3`` (CPython 3.12) has torch and the common packages
but cannot download; :data:`DISTS` is the rest, for CPython 3.12 on manylinux
x86_64: a wheel of this checkout, DeepSpeed built here without its ops (they
compile at first use there), the wheels it and Horovod need, and Horovod's
sdist (built there, with NCCL, by the check).  The folder travels with the
working tree, 64 MiB in all: the script fails beyond 56 MiB for the folder or
62 MiB for the two together.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / "gpu-wheels"
#: The GPU machine's interpreter.
PYTHON_VERSION = "3.12"
ABI = "cp312"
#: pip matches platform tags exactly: every manylinux level a wheel may carry.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
#: What travels may take this much; the device tool's limit is 64 MiB for the
#: working tree and the carried folders together.
LIMIT_MIB = 56.0
TRAVEL_LIMIT_MIB = 62.0


@dataclass(frozen=True)
class Dist:
    """One distribution to carry: ``how`` is ``download`` (a wheel from PyPI
    for CPython 3.12 manylinux), ``build`` (a pure-Python wheel built here)
    or ``sdist`` (the source archive, built on the GPU machine)."""

    name: str
    version: str
    how: str
    why: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def stem(self) -> str:
        """How the distribution's file names begin (wheel names normalise ``-`` to ``_``)."""
        return f"{self.name.replace('-', '_')}-{self.version}"


#: Versions are the ones this checkout's .venv runs with (see constraints.txt).
DISTS: tuple[Dist, ...] = (
    Dist("deepspeed", "0.19.8", "build", "the deepspeed backend (no ops built: pure Python)"),
    Dist("hjson", "3.1.0", "download", "DeepSpeed's config reader"),
    Dist("pydantic", "2.14.4", "download", "DeepSpeed's config model"),
    Dist("pydantic-core", "2.50.5", "download", "pydantic's compiled core (must match pydantic)"),
    Dist("annotated-types", "0.8.0", "download", "needed by pydantic"),
    Dist("typing-inspection", "0.4.5", "download", "needed by pydantic"),
    Dist("typing-extensions", "4.16.0", "download", "pydantic needs >= 4.16; the machine's may be older"),
    Dist("py-cpuinfo", "9.0.0", "download", "needed by DeepSpeed (believed present there; small)"),
    Dist("msgpack", "1.2.4", "download", "needed by DeepSpeed (believed present there; small)"),
    Dist("einops", "0.8.2", "download", "needed by DeepSpeed (believed present there; small)"),
    Dist("cffi", "2.1.1", "download", "Horovod's runtime need, missing there"),
    Dist("pycparser", "3.12", "download", "needed by cffi"),
    Dist("horovod", "0.28.1", "sdist", "built there with NCCL operations by the check"),
)


def mib(n_bytes: int) -> float:
    return n_bytes / 2**20


def download_command(dists: Iterable[Dist], dest: Path, python: str = sys.executable) -> list[str]:
    """One ``pip download`` of every wheel, for CPython 3.12 on manylinux x86_64
    (``--only-binary``: a source archive of the wrong platform must not slip in)."""
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        "--abi",
        ABI,
        "--abi",
        "abi3",
        "--abi",
        "none",
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "-d", str(dest), *(d.requirement for d in dists)]


def build_command(dist: Dist, dest: Path, python: str = sys.executable) -> list[str]:
    """A pure-Python wheel built from the sdist with this interpreter's torch
    (DeepSpeed's set-up imports torch: no build isolation)."""
    return [
        python,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-binary",
        dist.name,
        "-w",
        str(dest),
        dist.requirement,
    ]


def expected_stems(dists: Sequence[Dist] = DISTS) -> list[str]:
    return [d.stem for d in dists] + ["parallelx-"]


def check_folder(
    dest: Path,
    dists: Sequence[Dist] = DISTS,
    *,
    limit_mib: float = LIMIT_MIB,
    tree_bytes: int = 0,
    travel_limit_mib: float = TRAVEL_LIMIT_MIB,
) -> list[str]:
    """What is wrong with ``dest`` (an empty list when nothing is): a missing
    or doubled distribution, a wheel that CPython 3.12 on Linux x86_64 cannot
    install, or too many bytes to travel."""
    problems = []
    files = sorted(p for p in dest.iterdir() if p.is_file()) if dest.is_dir() else []
    if not files:
        return [f"{dest} holds no wheels; run `.venv/bin/python scripts/gpu_wheels.py`"]
    for stem in expected_stems(dists):
        hits = [p.name for p in files if p.name.lower().startswith(stem.lower())]
        if not hits:
            problems.append(f"missing {stem.rstrip('-')} in {dest}")
        elif len(hits) > 1:
            # pip refuses two versions of one distribution in one install.
            problems.append(f"{len(hits)} files for {stem.rstrip('-')} in {dest}: {', '.join(hits)}; keep one")
    known = tuple(s.lower() for s in expected_stems(dists))
    for p in files:
        if not p.name.lower().startswith(known):
            problems.append(f"unexpected file {p.name} in {dest}: remove it or add it to DISTS")
        elif p.suffix == ".whl" and not installable_on_target(p.name):
            problems.append(f"{p.name} is not for CPython {PYTHON_VERSION} on Linux x86_64")
    total = sum(p.stat().st_size for p in files)
    if mib(total) > limit_mib:
        problems.append(f"{dest} holds {mib(total):.1f} MiB, more than the {limit_mib:.0f} MiB allowed")
    if mib(total + tree_bytes) > travel_limit_mib:
        problems.append(
            f"wheels ({mib(total):.1f} MiB) and working tree ({mib(tree_bytes):.1f} MiB) together "
            f"exceed {travel_limit_mib:.0f} MiB; the device tool carries 64 MiB at most"
        )
    return problems


def installable_on_target(filename: str) -> bool:
    """Whether a wheel's tags (``name-ver-python-abi-platform.whl``) admit CPython 3.12 on x86_64 Linux."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    pythons, abis, platforms = (set(t.split(".")) for t in parts[-3:])
    minor = int(PYTHON_VERSION.split(".")[1])
    # abi3 wheels built for an older CPython 3 (cp38, ...) install on 3.12 too.
    stable = "abi3" in abis and any(p.startswith("cp3") and p[3:].isdigit() and int(p[3:]) <= minor for p in pythons)
    python_ok = bool(pythons & {"py3", f"py3{minor}", ABI}) or stable
    abi_ok = bool(abis & {"none", "abi3", ABI})
    platform_ok = "any" in platforms or any(p.endswith("x86_64") and "linux" in p for p in platforms)
    return python_ok and abi_ok and platform_ok


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what the device tool sends besides carried folders: tracked
    files and untracked ones that git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    return sum((root / f).stat().st_size for f in out.decode().split("\0") if f and (root / f).is_file())


def run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("[gpu-wheels] $ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def make(dest: Path) -> None:
    """Fill ``dest`` afresh (into a temporary folder first, so a failed
    download never leaves a half folder that looks complete)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-wheels-", dir=dest.parent))
    try:
        run(download_command([d for d in DISTS if d.how == "download"], tmp))
        for d in DISTS:
            if d.how == "build":  # DS_BUILD_OPS=0: no C++/CUDA ops, a pure-Python wheel
                run(build_command(d, tmp), env={**os.environ, "DS_BUILD_OPS": "0"})
            elif d.how == "sdist":
                run(
                    [
                        sys.executable,
                        "-m",
                        "pip",
                        "download",
                        "--no-deps",
                        "--no-binary",
                        ":all:",
                        "-d",
                        str(tmp),
                        d.requirement,
                    ]
                )
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(ROOT)])
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help="the folder to fill (default gpu-wheels/)")
    parser.add_argument("--check", action="store_true", help="only check an existing folder; download nothing")
    args = parser.parse_args(argv)
    if not args.check:
        make(args.dest)
    files = sorted(p for p in args.dest.iterdir() if p.is_file()) if args.dest.is_dir() else []
    for p in files:
        print(f"[gpu-wheels] {mib(p.stat().st_size):7.2f} MiB  {p.name}")
    tree = tree_bytes()
    total = sum(p.stat().st_size for p in files)
    print(
        f"[gpu-wheels] {mib(total):7.2f} MiB in {args.dest} ({len(files)} files); working tree "
        f"{mib(tree):.2f} MiB; together {mib(total + tree):.2f} MiB of the 64 MiB the device tool carries"
    )
    problems = check_folder(args.dest, tree_bytes=tree)
    for problem in problems:
        print(f"[gpu-wheels] error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
