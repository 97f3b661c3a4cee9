"""The built wheel, installed on its own: it holds every module of the checkout, and it runs
(``python -m parallelx env``, and ``recipes/example.py``'s installed twin under torchrun) from a
folder outside the checkout, with parallelx imported from the wheel only.

The new environment gets torch, numpy and the rest from this one's site-packages through a
``.pth`` line (nothing downloaded again); its own site-packages comes first on ``sys.path``,
and this environment's editable install of parallelx is not active there (its finder is set up
by a ``.pth`` file that only this environment's site processing reads), so a package missing
from the wheel fails to import."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.launcher, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
#: Checkout folder -> where its files go in the wheel.
INSTALLED_AS = {"parallelx": "parallelx", "backends": "parallelx/backends", "recipes": "parallelx/recipes"}


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 180) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def source_files() -> list[str]:
    """The checkout's files as git sees them (tracked or new, not ignored), without deleted ones."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    return sorted({f for f in listed if f and (ROOT / f).is_file()})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, list[str]]:
    """The wheel, built from a copy of the checkout (a build inside it would leave build/ there, and
    setuptools packs whatever stale modules build/lib holds), and the copied files."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = source_files()
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", str(src), "-w", str(tmp / "dist")], cwd=tmp)
    (wheel,) = (tmp / "dist").glob("parallelx-*.whl")
    return wheel, files


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """A new environment with the wheel in it; torch and the other dependencies come from this one."""
    wheel, _ = built
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=env_dir).strip())
    (site / "zz_parallelx_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet", str(wheel)],
        cwd=env_dir,
    )
    return env_dir


def outside_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    return env


def test_the_wheel_holds_every_module_of_the_checkout(built):
    """Every .py file under parallelx/, backends/ and recipes/ (so every subpackage), and the
    recipes' other files, are in the wheel under their installed names."""
    wheel, files = built
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for f in files:
        top, _, rest = f.partition("/")
        if top in INSTALLED_AS and rest and "__pycache__" not in f and (f.endswith(".py") or top == "recipes"):
            expected.add(f"{INSTALLED_AS[top]}/{rest}")
    packages = {e.rsplit("/", 1)[0] for e in expected if e.endswith("/__init__.py")}
    assert {
        "parallelx/parts",
        "parallelx/launching/environments",
        "parallelx/backends",
        "parallelx/recipes",
    } <= packages
    missing = sorted(expected - names)
    assert not missing, f"{wheel.name} lacks {len(missing)} files of the checkout:\n" + "\n".join(missing)
    stray = sorted(n for n in names if n.split("/")[0] not in ("parallelx",) and ".dist-info/" not in n)
    assert not stray, f"{wheel.name} installs names outside parallelx/: {stray}"


def test_the_installed_wheel_runs_outside_the_checkout(installed, tmp_path):
    python = str(installed / "bin" / "python")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = outside_env()

    where = run(
        [python, "-c", "import parallelx, parallelx.recipes.example as e; print(parallelx.__file__, e.__file__)"],
        work,
        env,
    )
    for path in map(Path, where.split()):
        assert path.resolve().is_relative_to(installed.resolve()), f"imported from {path}, not from the wheel"
        assert not path.resolve().is_relative_to(ROOT), f"imported from the checkout: {path}"

    report = run([python, "-m", "parallelx", "env"], work, env)
    assert "ddp" in report, report

    # An old module path of 0.3 (parallelx/_compat.py) still runs with -m, and says where it went.
    usage = run([python, "-W", "always::DeprecationWarning", "-m", "parallelx.ray", "--help"], work, env)
    assert "usage:" in usage and "parallelx.launching.ray_train" in usage, usage

    start = time.monotonic()
    out = run(
        [
            python, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "parallelx.recipes.example", "--backend", "ddp", "--epochs", "1", "--out", str(work / "example.pth"),
        ],
        work,
        env,
    )  # fmt: skip
    assert "epoch 1/1: train loss" in out and "acc" in out, out
    assert (work / "example.pth").is_file(), out
    assert time.monotonic() - start < 120, "the two-rank example took over two minutes"
