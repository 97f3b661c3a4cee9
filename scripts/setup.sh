#!/usr/bin/env bash
# Create .venv and install parallelx into it, in one of two modes:
#   setup.sh core   torch, torchvision and parallelx's own dependencies: what the DDP demo
#                   (make train) needs, a few minutes on a fresh machine;
#   setup.sh all    (the default) everything the tests, lint and docs need besides: DeepSpeed,
#                   Ray, the trackers, the dev and docs tools, Horovod's build (7 minutes the
#                   first time, then cached), DeepSpeed's op pre-built, and as root the
#                   Debian packages of the test tier (Slurm, sshd).
# Both use the same .venv: core first, the rest added on top.  Idempotent per mode: a
# second run with unchanged inputs only checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-all}"
# test: as all, but Horovod's build (minutes, the first time) runs in the background while the
# tests that do not need it run; the tests that do wait for it (tests/support/horovod_build.py).
case "$MODE" in
    core | all | test) ;;
    *)
        echo "usage: $0 [core|all|test]" >&2
        exit 2
        ;;
esac

VENV="${PARALLELX_VENV:-.venv}"
PY="$VENV/bin/python"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/$VENV/torch_extensions}"
# DeepSpeed's op is built with the first ninja on PATH: this environment's, as the deepspeed backend does
# (two ninja versions hash the same build differently and rebuild each other's).
export PATH="$PWD/$VENV/bin:$PATH"
start=$(date +%s)

if [ ! -x "$PY" ]; then
    echo "[setup] creating $VENV"
    python3 -m venv "$VENV"
fi

# The test tier's Debian packages: the full set-up only.
if [ "$MODE" != core ]; then
    # A one-machine Slurm for the tests (tests/system/test_slurm.py starts its
    # daemons): Debian's packages, about 20 s.  Only as root; without them those
    # tests skip and say why.
    if ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "[setup] installing slurm-wlm and munge (the test tier's one-machine Slurm)"
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                slurm-wlm munge >/dev/null; } || echo "[setup] warning: could not install Slurm; its tests will skip" >&2
        else
            echo "[setup] note: Slurm (slurm-wlm, munge) is not installed and this is not root: its tests will skip" >&2
        fi
    fi

    # An ssh server for the tests' two-node rehearsal (tests/system/test_netns.py
    # starts one inside each node's network namespace, with a key of its own; no
    # system-wide sshd is configured): Debian's openssh-server, a few seconds.  Only
    # as root; without it the horovodrun-over-ssh test skips.
    if [ ! -x /usr/sbin/sshd ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "[setup] installing openssh-server (the two-node tests' ssh between namespaces)"
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
                openssh-server >/dev/null; } || echo "[setup] warning: could not install openssh-server; its test will skip" >&2
        else
            echo "[setup] note: openssh-server is not installed and this is not root: the horovodrun-over-ssh test will skip" >&2
        fi
    fi
fi

# Re-install only when the inputs of the install changed: one stamp per mode, each a hash of
# that mode's inputs.  A full set-up does the core part first (and stamps it), then the rest.
core_stamp="$VENV/.parallelx-core"
all_stamp="$VENV/.parallelx-all"
core_want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
all_want=$(cat pyproject.toml constraints.txt scripts/setup.sh scripts/build_horovod.py | sha256sum | cut -d' ' -f1)
current() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

if [ "$MODE" = core ] && current "$core_stamp" "$core_want"; then
    echo "[setup] $VENV is up to date (core)"
    exit 0
fi
rest_stamp="$VENV/.parallelx-rest"
status="$VENV/horovod-build.status"
if [ "$MODE" != core ] && current "$all_stamp" "$all_want"; then
    echo "[setup] $VENV is up to date (all)"
    echo done >"$status"
    exit 0
fi
if [ "$MODE" = test ] && current "$rest_stamp" "$all_want" && [ "$(cat "$status" 2>/dev/null)" = running ]; then
    echo "[setup] $VENV is up to date but for Horovod, whose build is under way (log: $VENV/horovod-build.log)"
    exit 0
fi

# The project's pins replace any machine-wide pip constraint file (PIP_CONSTRAINT
# overrides pip.conf's `constraint`): a cap left there by another project would
# otherwise refuse these releases.  Other pip settings (index, proxy) still apply.
export PIP_CONSTRAINT="$PWD/constraints.txt"

if ! current "$core_stamp" "$core_want"; then
    "$PY" -m pip install --quiet --upgrade pip wheel setuptools
    echo "[setup] installing torch, torchvision and parallelx (core; about 1.5 minutes from fresh)"
    "$PY" -m pip install --quiet -e .
    echo "$core_want" >"$core_stamp"
    echo "[setup] core done in $(($(date +%s) - start)) s"
fi
if [ "$MODE" = core ]; then
    exit 0
fi

# Horovod: built (7 minutes on 2 cores the first time, then cached), its build checked for PyTorch and Gloo.
horovod() {
    "$PY" scripts/build_horovod.py || return 1
    local check
    check=$("$VENV/bin/horovodrun" --check-build) || return 1
    echo "$check"
    for need in PyTorch Gloo; do
        grep -q "\[X\] $need" <<<"$check" || { echo "[setup] horovod was built without $need support" >&2; return 1; }
    done
}

if [ "$MODE" = test ] && ! current "$all_stamp" "$all_want"; then
    # In the background from here (it needs torch only), below the tests' priority: it takes the cores
    # that pip's downloads and the tests' waits on launches leave; the tests that need Horovod wait for
    # its status (tests/support/horovod_build.py).
    echo running >"$status"
    echo "[setup] building horovod in the background (log: $VENV/horovod-build.log); the tests that need it wait for it"
    (
        renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true # the build's processes inherit it
        if horovod >"$VENV/horovod-build.log" 2>&1; then
            echo "$all_want" >"$all_stamp"
            echo done >"$status"
        else
            echo failed >"$status"
        fi
    ) </dev/null >/dev/null 2>&1 &
fi

if ! current "$rest_stamp" "$all_want"; then
    echo "[setup] installing deepspeed, ray, the trackers, the dev and docs tools (about 2 minutes from fresh)"
    "$PY" -m pip install --quiet -e ".[deepspeed,ray,trackers,dev,docs]"
    # DeepSpeed JIT-compiles a shared-memory op for CPU communication on first
    # use (~40 s, cached under TORCH_EXTENSIONS_DIR).  Build it here, in one
    # process, rather than in two ranks racing at the first launch.
    "$PY" - <<'PYEOF' || echo "[setup] warning: could not pre-build DeepSpeed's CPU comm op" >&2
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":
    get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
PYEOF
    echo "$all_want" >"$rest_stamp"
fi

if [ "$MODE" = test ]; then
    echo "[setup] done but for Horovod in $(($(date +%s) - start)) s"
    exit 0
fi

if [ "$(cat "$status" 2>/dev/null)" = running ] && pgrep -f "scripts/build_horovod.py" >/dev/null; then
    echo "[setup] waiting for the Horovod build that make test started in the background"
    while [ "$(cat "$status")" = running ]; do sleep 5; done
    if current "$all_stamp" "$all_want"; then
        echo "[setup] done in $(($(date +%s) - start)) s"
        exit 0
    fi
fi
echo "[setup] installing horovod (a 7-minute build the first time, then cached)"
echo running >"$status"
horovod || { echo failed >"$status"; exit 1; }
echo done >"$status"
echo "$all_want" >"$all_stamp"
echo "[setup] done in $(( $(date +%s) - start )) s"
