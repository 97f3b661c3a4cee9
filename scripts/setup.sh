#!/usr/bin/env bash
# Create .venv and install parallelx into it, in one of two modes:
#   setup.sh core   torch, torchvision and parallelx's own dependencies: what the DDP demo
#                   (make train) needs, a few minutes on a fresh machine;
#   setup.sh all    (the default) everything the tests, lint and docs need besides: DeepSpeed,
#                   Ray, the trackers, the dev and docs tools, Horovod's build (2.5 minutes the
#                   first time, then cached), DeepSpeed's op pre-built, and as root the
#                   Debian packages of the test tier (Slurm, sshd).
# Both use the same .venv: core first, the rest added on top.  Idempotent per mode: a
# second run with unchanged inputs only checks a stamp and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE="${1:-all}"
# test: what make test needs: all but Horovod (its tests are scenarios: its build alone is 4 CPU-minutes
# on a fresh machine), Ray, the docs tools and the Debian packages of the scenarios.
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

# The scenarios' Debian packages (make test-scenarios): the full set-up only.
if [ "$MODE" = all ]; then
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

# Re-install only when the inputs of the install changed: one stamp per step, each a hash of
# that step's inputs.  A full set-up does the core part first (and stamps it), then the test
# tools, then the rest.
core_stamp="$VENV/.parallelx-core"
test_stamp="$VENV/.parallelx-test" # deepspeed, the trackers, the dev tools (Horovod apart)
extra_stamp="$VENV/.parallelx-extra" # ray and the docs tools
horovod_stamp="$VENV/.parallelx-horovod" # Horovod built and checked
all_stamp="$VENV/.parallelx-all" # all of it
core_want=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
all_want=$(cat pyproject.toml constraints.txt scripts/setup.sh scripts/build_horovod.py | sha256sum | cut -d' ' -f1)
current() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

if [ "$MODE" = core ] && current "$core_stamp" "$core_want"; then
    echo "[setup] $VENV is up to date (core)"
    exit 0
fi
if current "$all_stamp" "$all_want" || { [ "$MODE" = test ] && current "$test_stamp" "$all_want"; }; then
    echo "[setup] $VENV is up to date ($MODE)"
    exit 0
fi

# The project's pins replace any machine-wide pip constraint file (PIP_CONSTRAINT
# overrides pip.conf's `constraint`): a cap left there by another project would
# otherwise refuse these releases.  Other pip settings (index, proxy) still apply.
export PIP_CONSTRAINT="$PWD/constraints.txt"

# The installer: uv where it can be had (measured here on a fresh machine: torch and torchvision in
# 15 s against pip's 150 s; the test tools in 7 s against 130 s), pip otherwise (PARALLELX_INSTALLER=pip
# forces it).  uv does not read pip's configuration: an index given to pip by its environment variables
# is handed on, and an install uv cannot do is done again by pip.
install() {
    if [ "${PARALLELX_INSTALLER:-uv}" = uv ] && { [ -x "$VENV/bin/uv" ] || "$PY" -m pip install --quiet uv >/dev/null 2>&1; }; then
        if (
            [ -n "${PIP_INDEX_URL:-}" ] && export UV_DEFAULT_INDEX="$PIP_INDEX_URL"
            [ -n "${PIP_EXTRA_INDEX_URL:-}" ] && export UV_INDEX="$PIP_EXTRA_INDEX_URL"
            [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ] && export SSL_CERT_FILE="$PIP_CERT"
            # Hard links where uv's cache and the venv share a file system: a copy would hold torch's
            # 6 GB twice (CI's disk once ran out with it).  A copy where they do not.
            if [ -z "${UV_LINK_MODE:-}" ]; then
                cache=$("$VENV/bin/uv" cache dir 2>/dev/null) && mkdir -p "$cache" &&
                    [ "$(stat -c %d "$cache")" = "$(stat -c %d "$VENV")" ] && export UV_LINK_MODE=hardlink ||
                    export UV_LINK_MODE=copy
            fi
            # Bytecode compiled here, on every core (uv leaves it to the first import otherwise: each
            # process of the first launch would compile torch again, a minute on 2 cores).
            "$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$PY" --constraint "$PIP_CONSTRAINT" "$@"
        ); then
            return 0
        fi
        echo "[setup] uv could not install $*; pip instead" >&2
    fi
    "$PY" -m pip install --quiet "$@"
}

if ! current "$core_stamp" "$core_want"; then
    "$PY" -m pip install --quiet --upgrade pip wheel setuptools
    echo "[setup] installing torch, torchvision and parallelx (core; under a minute from fresh)"
    install -e .
    echo "$core_want" >"$core_stamp"
    echo "[setup] core done in $(($(date +%s) - start)) s"
fi
if [ "$MODE" = core ]; then
    exit 0
fi

# Horovod: built (about 2.5 minutes on 2 cores the first time, then cached), its build checked for PyTorch and Gloo.
horovod() {
    "$PY" scripts/build_horovod.py || return 1
    local check
    check=$("$VENV/bin/horovodrun" --check-build) || return 1
    echo "$check"
    for need in PyTorch Gloo; do
        grep -q "\[X\] $need" <<<"$check" || { echo "[setup] horovod was built without $need support" >&2; return 1; }
    done
}

if ! current "$test_stamp" "$all_want"; then
    echo "[setup] installing deepspeed, the trackers, the s3 extra and the dev tools with the tests' S3 store (seconds with uv)"
    install -e ".[deepspeed,trackers,s3,dev]"
    # DeepSpeed JIT-compiles a shared-memory op for CPU communication on first
    # use (~40 s, cached under TORCH_EXTENSIONS_DIR).  Build it here, in one
    # process, rather than in two ranks racing at the first launch: for make test in the
    # background (a launch that needs it meanwhile waits on torch's lock in that folder).
    prebuild() {
        "$PY" - <<'PYEOF' || echo "[setup] warning: could not pre-build DeepSpeed's CPU comm op" >&2
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":
    get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
PYEOF
    }
    if [ "$MODE" = test ]; then
        prebuild >"$VENV/deepspeed-op-build.log" 2>&1 </dev/null &
    else
        prebuild
    fi
    echo "$all_want" >"$test_stamp"
fi

# The tests write up to 3 GiB at once (VGG16 checkpoints of 470 MB each; measured over the whole
# scenario tier); a disk that fills mid-run fails them late with torch's "unexpected pos".
disk_check() {
    local free
    free=$(df -Pk "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ -n "$free" ] && [ "$free" -lt 4 ]; then
        echo "[setup] warning: ${free} GiB free in ${TMPDIR:-/tmp}; the tests need about 4 GiB" >&2
    fi
}

if [ "$MODE" = test ]; then
    disk_check
    echo "[setup] done (make test's part: no Horovod, Ray or docs tools) in $(($(date +%s) - start)) s"
    exit 0
fi

# The scenarios' and the docs' tools: Ray Train (an 80 MB wheel), MkDocs and its plugins.
if ! current "$extra_stamp" "$all_want"; then
    echo "[setup] installing ray and the docs tools (seconds with uv, about 1 minute with pip)"
    install -e ".[deepspeed,ray,trackers,s3,dev,docs]"
    echo "$all_want" >"$extra_stamp"
fi

if ! current "$horovod_stamp" "$all_want"; then
    echo "[setup] installing horovod (a 2-minute build on 2 cores the first time, then cached)"
    horovod
    echo "$all_want" >"$horovod_stamp"
fi
echo "$all_want" >"$all_stamp"
disk_check
echo "[setup] done in $(( $(date +%s) - start )) s"
