"""Trackers, throughput and profiles under the real launchers, 2 processes each:
``tests/support/tracking_worker.py`` (the public API only: ``backend.batches``,
``backward``, ``step``, ``log_metrics``) under ddp (torchrun, with
``--profile-steps 2:3``), deepspeed ZeRO-3 (the deepspeed launcher) and fsdp
(torchrun) with ``--logger tensorboard,mlflow,csv``, and under horovod
(horovodrun) with ``--logger csv,wandb``.  What each run wrote is read back
through the trackers' own readers (TensorBoard's ``EventAccumulator``,
``MlflowClient``, the CSV file, W&B's offline summary) and compared with the
script's own record:

- the validation loss of every epoch and the mean training loss of every
  optimizer step, exactly (float32 in TensorBoard's event files);
- one writer per run: one event file, one MLflow run (FINISHED, with the
  parsed arguments and the backend's options as parameters);
- throughput: the samples of all intervals add up to the samples trained,
  and the intervals' wall time to the training passes' within 10 %;
- the FLOPs counted on the wrapped or sharded model (DDP, ZeRO-3, FSDP2)
  are LeNet's analytic forward+backward count per sample; with
  ``--peak-tflops`` the MFU is FLOP/s per rank over that peak;
- ``--profile-steps 2:3`` (ddp, horovod) leaves one Chrome trace per rank
  that loads as JSON and holds both steps; rank 0 prints the operations table once;
- MLflow writes to ``$MLFLOW_TRACKING_URI`` when it is set (fsdp), else to
  the SQLite file in the run directory.
"""

from __future__ import annotations

import csv
import json
import struct
from collections import defaultdict
from pathlib import Path

import pytest
from launching import backend_cases, in_make_test, launch, require_launcher

# Scenarios: the trackers under the launchers (tests/unit/test_tracking.py reads them back in make test).
pytestmark = [pytest.mark.launcher, pytest.mark.scenario, pytest.mark.timeout(300)]

WORKER = "tests/support/tracking_worker.py"
EPOCHS, BATCH, TRAIN = 2, 16, 256
#: LeNet's forward+backward FLOPs per 3x32x32 sample (tests/unit/test_tracking.py derives it from the layers).
LENET_TRAIN_FLOPS = 3_146_400
RUNS: dict[str, tuple[str, str, list[str], list[str]]] = {
    # name: (launcher, backend, its arguments, this run's own arguments)
    "ddp": (*backend_cases("ddp")["ddp"], ["--logger", "tensorboard,mlflow,csv", "--profile-steps", "2:3"]),
    "deepspeed-zero3": (
        *backend_cases("deepspeed-zero3")["deepspeed-zero3"],
        ["--logger", "tensorboard,mlflow,csv", "--logger-every", "3", "--peak-tflops", "2"],
    ),
    "fsdp": (*backend_cases("fsdp")["fsdp"], ["--logger", "tensorboard,mlflow,csv", "--logger-every", "5"]),
    "horovod": (*backend_cases("horovod")["horovod"], ["--logger", "csv,wandb", "--profile-steps", "2:3"]),
}


def read_csv(run: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with (run / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            series[row["name"]].append((int(row["step"]), float(row["value"])))
    return series


def read_tensorboard(run: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(run.rglob("events.out.tfevents.*"))
    assert len(events) == 1, f"one writer per run: expected one event file, found {events}"
    acc = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_mlflow(uri: str) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    assert len(runs) == 1, f"one writer per run: expected one MLflow run, found {len(runs)}"
    info = runs[0].info
    assert info.status == "FINISHED", info.status
    series = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(info.run_id, key))
        for key in runs[0].data.metrics
    }
    return series, runs[0].data.params


def read_wandb(run: Path) -> dict[str, list[tuple[int, float]]]:
    """The history of the one offline W&B run, from its ``.wandb`` file: W&B's own
    ``Record`` protobuf messages in its append-only log (blocks of 32 KiB, each
    record a 7-byte header: crc, length, kind (1 whole, 2 first, 3 middle, 4 last part))."""
    from wandb.proto.wandb_internal_pb2 import Record

    files = list(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"one writer per run: expected one offline W&B run, found {files}"
    data, pos, part = files[0].read_bytes(), 7, b""  # after the file header (":W&B", magic, version)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (2, 3):
            part = (part if kind == 3 else b"") + chunk
            continue
        record = Record()
        record.ParseFromString(part + chunk if kind == 4 else chunk)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            for key, value in items.items():
                if not key.startswith("_") and key != "step":
                    series[key].append((items["step"], value))
    return series


def check_series(series: dict[str, list[tuple[int, float]]], record: dict, *, rel: float, where: str) -> None:
    val = [v for _, v in sorted(series["val_loss"])]
    assert val == pytest.approx(record["val_loss"], rel=rel), f"{where}: validation loss per epoch"
    train = sorted(series["train/loss"])
    assert [s for s, _ in train] == list(range(1, record["steps"] + 1)), f"{where}: a training loss per step"
    assert [v for _, v in train] == pytest.approx(record["train_loss"], rel=rel), f"{where}: training loss per step"


def check_throughput(series: dict[str, list[tuple[int, float]]], record: dict, *, where: str) -> None:
    wall = dict(series["time/interval_s"])
    rate = dict(series["throughput/samples_per_s"])
    assert wall.keys() == rate.keys() and wall, f"{where}: an interval without its throughput"
    samples = sum(rate[s] * wall[s] for s in wall)
    assert samples == pytest.approx(record["samples"], rel=1e-6), f"{where}: intervals' samples vs samples trained"
    # The intervals run from step to step inside the training passes: never the validation between them (which
    # would put them above), nor much less than the passes.  What lies between is the first batch's loading and
    # the last micro-batch's tail, a share that a loaded machine's pauses can raise, so no tighter bound.
    covered = sum(wall.values()) / record["train_s"]
    assert 0.5 <= covered <= 1.02, (
        f"{where}: intervals' wall time {sum(wall.values()):.3f} s vs the training passes' {record['train_s']:.3f} s"
    )
    flops = dict(series["throughput/flops_per_s"])
    assert sum(flops[s] * wall[s] for s in wall) / record["samples"] == pytest.approx(LENET_TRAIN_FLOPS, rel=1e-9), (
        f"{where}: FLOPs per sample counted on the wrapped model"
    )
    per_rank = dict(series["throughput/samples_per_s_per_rank"])
    assert all(per_rank[s] == pytest.approx(rate[s] / record["world_size"]) for s in rate)
    for key in ("time/step_s", "time/data_s", "time/forward_backward_s", "time/optimizer_s"):
        assert len(series[key]) == len(wall) and all(v >= 0 for _, v in series[key]), key
    step = dict(series["time/step_s"])
    parts = {
        s: sum(dict(series[k])[s] for k in ("time/data_s", "time/forward_backward_s", "time/optimizer_s")) for s in wall
    }
    assert all(parts[s] <= step[s] * 1.001 for s in wall), f"{where}: the step's parts exceed the step: {parts} {step}"


@pytest.mark.parametrize("run", in_make_test(RUNS, "ddp", "deepspeed-zero3"))
def test_trackers_read_back_what_the_script_logged(run, tmp_path, monkeypatch):
    launcher, backend, extra, own = RUNS[run]
    require_launcher(launcher)
    monkeypatch.delenv("WANDB_MODE", raising=False)  # W&B runs offline unless told otherwise
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    # MLflow writes to $MLFLOW_TRACKING_URI when it is set (fsdp's run), else to a SQLite file in the run directory.
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}" if run == "fsdp" else f"sqlite:///{out / 'mlflow.db'}"
    res = launch(
        launcher,
        [WORKER, "--backend", backend, *extra, *own, "--logger-dir", str(out), "--record", str(out / "record.json")],
        env={"WANDB_SILENT": "true", **({"MLFLOW_TRACKING_URI": uri} if run == "fsdp" else {})},
        timeout=240,
    )
    assert res.returncode == 0, res.tail()
    record = json.loads((out / "record.json").read_text())
    assert record["steps"] == EPOCHS * TRAIN // (2 * BATCH) and record["samples"] == EPOCHS * TRAIN

    series = read_csv(out)
    check_series(series, record, rel=1e-12, where="csv")
    check_throughput(series, record, where="csv")
    params = json.loads((out / "hparams.json").read_text())
    assert params["parallelx/backend"] == backend and params["parallelx/world_size"] == 2
    assert params["epochs"] == EPOCHS and params["batch_size"] == BATCH  # the parsed arguments

    if "tensorboard" in own[1]:
        tb = read_tensorboard(out)
        check_series(tb, record, rel=1e-6, where="tensorboard")  # event files hold float32
        assert dict(tb["throughput/samples_per_s"]) == pytest.approx(dict(series["throughput/samples_per_s"]), rel=1e-6)
        ml, ml_params = read_mlflow(uri)
        assert (out / "mlflow.db").exists() == (run != "fsdp")
        check_series(ml, record, rel=1e-12, where="mlflow")
        check_throughput(ml, record, where="mlflow")
        assert ml_params["parallelx/backend"] == backend and ml_params["epochs"] == str(EPOCHS)
    if "--peak-tflops" in own:
        mfu, per_rank = dict(series["throughput/mfu"]), dict(series["throughput/flops_per_s_per_rank"])
        assert mfu and all(mfu[s] == pytest.approx(per_rank[s] / 2e12) for s in mfu)
    else:
        assert "throughput/mfu" not in series
        assert "MFU is not reported: no peak FLOP/s is known for the cpu" in res.output
    if "--profile-steps" in own:
        for rank in (0, 1):
            trace = json.loads((out / "profile" / f"trace_rank{rank}.json").read_text())
            names = {e.get("name") for e in trace["traceEvents"]}
            assert {"step 2", "step 3"} <= names and "step 1" not in names, f"rank {rank}"
        assert res.output.count("profile of optimizer steps 2:3") == 1, res.tail()
    if "wandb" in own[1]:
        wb = read_wandb(out)
        check_series(wb, record, rel=1e-12, where="wandb")
        check_throughput(wb, record, where="wandb")


def test_the_cifar10_recipe_logs_its_history_and_steps_to_every_tracker(tmp_path, monkeypatch):
    """The recipe, unchanged, with ``--logger tensorboard,mlflow,csv`` under torchrun:
    each tracker, read through its own reader, holds history.csv's validation
    loss and accuracy of every epoch, the training loss of every optimizer step,
    one writer each, and the throughput of the training passes."""
    require_launcher("torchrun")
    from recipes.make_data import make_cifar10

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data, out, logs = tmp_path / "cifar", tmp_path / "out", tmp_path / "logs"
    make_cifar10(data, n_train=160, n_test=21, seed=0)
    args = ["--data-dir", str(data), "--out-dir", str(out), "--epochs", "2", "--batch-size", "16", "--num-workers", "0"]
    res = launch(
        "torchrun",
        [
            "-m",
            "recipes.cifar10",
            "--backend",
            "ddp",
            *args,
            "--logger",
            "tensorboard,mlflow,csv",
            "--logger-dir",
            str(logs),
        ],
        timeout=240,
    )
    assert res.returncode == 0, res.tail()
    with (out / "history.csv").open() as f:
        history = list(csv.DictReader(f))
    steps = sum(int(row["optimizer_steps"]) for row in history)
    assert len(history) == 2 and steps == 2 * 5  # 160 images, 2 ranks of 16
    for where, series in (
        ("csv", read_csv(logs)),
        ("tensorboard", read_tensorboard(logs)),
        ("mlflow", read_mlflow(f"sqlite:///{logs / 'mlflow.db'}")[0]),
    ):
        rel = 1e-6 if where == "tensorboard" else 1e-12  # event files hold float32
        for name in ("val_loss", "val_acc", "train_loss"):
            logged = [v for _, v in sorted(series[name])]
            assert logged == pytest.approx([float(row[name]) for row in history], rel=rel), f"{where}: {name}"
        assert [s for s, _ in sorted(series["train/loss"])] == list(range(1, steps + 1)), f"{where}: train/loss"
        wall, rate = dict(series["time/interval_s"]), dict(series["throughput/samples_per_s"])
        assert wall and wall.keys() == rate.keys(), f"{where}: throughput"
        assert sum(rate[s] * wall[s] for s in wall) == pytest.approx(2 * 160, rel=1e-6), f"{where}: samples"
