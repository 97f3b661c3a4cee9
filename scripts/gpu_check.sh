#!/usr/bin/env bash
# The GPU check in one command, on a machine with CUDA and no network (README: "GPU check"):
#
#     bash scripts/gpu_check.sh            # from anywhere; finishes within 8 minutes
#
# Installs the wheels in gpu-wheels/ (made by `.venv/bin/python scripts/gpu_wheels.py`) into gpu-site/
# with `pip install --no-index --no-deps --target` (the machine's python3 is itself a venv, so a
# `--system-site-packages` venv made from it would not see its torch; PYTHONPATH reaches every process
# the launchers start), then runs scripts/gpu_check.py with the arguments given (`--dry-run`, `--only`).
# The report goes to $OUT, else gpu-report/: report.md, summary.json, install.log, logs.tar.gz.
# Settings: PYTHON (python3), GPU_WHEELS, GPU_SITE, GPU_CHECK_BUDGET_S (480, installation included),
# GPU_CHECK_KEEP_WORK=1 (keep the scratch folder).  Exit status: gpu_check.py's.
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
DEADLINE=$((START + BUDGET_S))
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-gpu-wheels}
SITE=${GPU_SITE:-gpu-site}
OUT_DIR=${OUT:-gpu-report}
# Absolute paths: gpu_check.py's launches run in a scratch folder.
case $SITE in /*) ;; *) SITE="$PWD/$SITE" ;; esac
case $OUT_DIR in /*) ;; *) OUT_DIR="$PWD/$OUT_DIR" ;; esac
WORK=$(mktemp -d /tmp/gpu-check-XXXXXX)
LOG="$OUT_DIR/install.log"
STEPS="$WORK/install-steps.tsv"
mkdir -p "$OUT_DIR"
: >"$LOG"
: >"$STEPS"

# step NAME TIMEOUT_S DESCRIPTION CMD...: run CMD with its output in the
# install log; record NAME, its exit status, seconds and a detail for the report
# (DESCRIPTION, or CMD's last line of output when DESCRIPTION is empty or CMD failed).
step() {
    local name=$1 limit=$2 desc=$3
    shift 3
    local t0 rc ms detail
    t0=$(date +%s%N)
    echo "\$ $*" >>"$LOG"
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    detail=$desc
    if [ "$rc" -ne 0 ] || [ -z "$desc" ]; then
        detail=$(grep -v '^\s*$' "$LOG" | tail -n 1 | tr '\t' ' ' | cut -c1-300)
        [ "$rc" -eq 124 ] && detail="timed out after ${limit}s: $detail"
    fi
    printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$detail" >>"$STEPS"
    echo "[gpu-check] install / $name: $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (exit status $rc)") in $((ms / 1000))s"
    return "$rc"
}

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
sdists=("$WHEELS"/horovod-*.tar.gz)
shopt -u nullglob
echo "[gpu-check] $("$PY" --version 2>&1) at $(command -v "$PY"); ${#wheels[@]} wheels in $WHEELS; budget ${BUDGET_S}s"

if [ "${#wheels[@]}" -eq 0 ]; then
    printf '%s\t%s\t%s\t%s\n' "carried wheels" 1 0 \
        "no wheels in $WHEELS/: run \`.venv/bin/python scripts/gpu_wheels.py\` on a networked machine and carry the folder" \
        >>"$STEPS"
else
    rm -rf "$SITE"
    step "carried wheels" 180 "${#wheels[@]} wheels into $SITE (pip --no-index --no-deps --target)" \
        "$PY" -m pip install --no-index --no-deps --disable-pip-version-check --target "$SITE" "${wheels[@]}"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
# From the scratch folder: `python -c` puts the current folder first, and the checkout's own
# parallelx/ would shadow the installed one.
step "parallelx importable" 60 "" bash -c 'cd "$1" && "$2" -c "$3"' _ "$WORK" "$PY" \
    "import parallelx; print('parallelx', parallelx.__version__, 'at', parallelx.__file__)"

args=(--deadline "$DEADLINE" --out "$OUT_DIR" --work "$WORK" --site "$SITE" --install-steps "$STEPS")
[ "${#sdists[@]}" -gt 0 ] && args+=(--horovod-sdist "${sdists[0]}")
# gpu_check.py keeps to the deadline itself; this timeout only guards against a hang past it.
left=$((DEADLINE - $(date +%s) + 20))
timeout --signal=TERM --kill-after=15 "$left" "$PY" scripts/gpu_check.py "${args[@]}" "$@"
rc=$?
[ "$rc" -eq 124 ] && echo "[gpu-check] gpu_check.py ran past the budget and was stopped; its report is partial" >&2

# Every launch's output, in one file (the device tool brings back a few files only).
tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs 2>/dev/null || echo "[gpu-check] could not pack $WORK/logs" >&2
# The runs hold 0.5 GB VGG16 checkpoints; GPU_CHECK_KEEP_WORK=1 keeps them.
[ "${GPU_CHECK_KEEP_WORK:-0}" = 1 ] && echo "[gpu-check] kept $WORK" || rm -rf "$WORK"
echo "[gpu-check] done in $(( $(date +%s) - START ))s with exit status $rc; report: $OUT_DIR/report.md"
exit "$rc"
