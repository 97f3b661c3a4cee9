#!/usr/bin/env bash
# The GPU check in one command, on a machine with CUDA and no network (docs/gpu-check.md):
#
#     bash scripts/gpu_check.sh            # from anywhere; finishes within 8 minutes
#
# Runs scripts/gpu_check.py with the arguments given (`--dry-run`, `--only`, `--work DIR` to keep the
# scratch folder), which first installs the wheels in gpu-wheels/ (made by `.venv/bin/python
# scripts/gpu_wheels.py`) into gpu-site/.  The report goes to $OUT, else gpu-report/: report.md,
# summary.json, logs.tar.gz.  Settings: PYTHON (python3), GPU_WHEELS, GPU_SITE, GPU_CHECK_BUDGET_S
# (480).  Exit status: gpu_check.py's.
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
DEADLINE=$(($(date +%s) + BUDGET_S))
# gpu_check.py keeps to the deadline itself; this timeout only guards against a hang past it.
timeout --signal=TERM --kill-after=15 $((BUDGET_S + 20)) "${PYTHON:-python3}" scripts/gpu_check.py \
    --deadline "$DEADLINE" --out "${OUT:-gpu-report}" --wheels "${GPU_WHEELS:-gpu-wheels}" \
    --site "${GPU_SITE:-gpu-site}" "$@"
rc=$?
[ "$rc" -eq 124 ] && echo "[gpu-check] gpu_check.py ran past the budget and was stopped; its report is partial" >&2
exit "$rc"
