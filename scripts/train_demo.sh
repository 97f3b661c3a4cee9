#!/usr/bin/env bash
# The main job: CIFAR-10 LeNet, 2 DDP processes under torchrun, on a generated
# stand-in for CIFAR-10 (the real data cannot be downloaded here; with network
# access, `python -m recipes.cifar10 --download --data-dir data/cifar10` gets it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DATA=${DATA:-data/cifar10-generated}
OUT=${OUT:-runs/cifar10-ddp}
EPOCHS=${EPOCHS:-3}

if [ ! -f "$DATA/cifar-10-batches-py/test_batch" ]; then
    "$PY" -m recipes.make_data cifar10 --out "$DATA" --train 10000 --test 2000
fi
# The backend's own launcher (torchrun), on the loopback interface and a free port.
"$PY" -m parallelx launch ddp -n 2 -- -m recipes.cifar10 --data-dir "$DATA" --epochs "$EPOCHS" --out-dir "$OUT"
echo
echo "outputs: $OUT/best.pth (weights), $OUT/last.pth, $OUT/history.csv, $OUT/metrics.json, $OUT/training_results.png"
