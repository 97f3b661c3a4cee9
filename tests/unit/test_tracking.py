"""Trackers, throughput and profiles in this process: ``log_metrics`` on the
in-process backend read back through the trackers' own readers, the
reduction across ranks in a world of threads, the options and their errors,
third-party trackers, the throughput formulas against a clock driven by
hand, LeNet's FLOPs against their analytic count, the peak table, and a
profile's trace.  The launches are in ``tests/launcher/test_tracking_launch.py``."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from threads import Meeting, ThreadBackend, no_forensics
from torch import nn

import parallelx
from parallelx import ParallelxError
from parallelx.backend import Backend
from parallelx.observability import MonitorOptions, Tracker, monitor, register_tracker, throughput
from parallelx.observability.trackers import catalog as registry
from parallelx.observability.trackers.catalog import _REGISTERED
from recipes.models import LeNet

pytestmark = pytest.mark.timeout(120)


def _data(n: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 2, (batch,), generator=g)) for _ in range(n)]


def _train(backend: Backend, data: list, epochs: int = 1, *, log: Any = None) -> list[float]:
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = backend.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for _ in range(epochs):
        for x, y in backend.batches(data):
            loss = nn.functional.cross_entropy(model(x), y)
            backend.backward(loss)
            if backend.step(opt) is not None:
                losses.append(loss.item())
                if log is not None:
                    log(backend, loss)
    return losses


def read_csv(run: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with (run / "metrics.csv").open() as f:
        for row in csv.DictReader(f):
            series[row["name"]].append((int(row["step"]), float(row["value"])))
    return series


# ------------------------------------------------------------------ log_metrics on one process
def test_values_are_read_once_per_interval_and_every_tracker_gets_them(tmp_path, monkeypatch):
    reads: list[int] = []
    real_read = monitor._read_device_values
    monkeypatch.setattr(
        monitor, "_read_device_values", lambda entries: (reads.append(len(entries)), real_read(entries))
    )
    run = tmp_path / "run"
    pending: list[int] = []

    def log(backend: Backend, loss: torch.Tensor) -> None:
        kept = loss.detach().clone()
        backend.log_metrics({"loss": kept, "lr": 0.1, "flag": True})
        kept.add_(100)  # changed in place after the call: the logged value stays what it was
        pending.append(len(backend.monitor._pending))

    with parallelx.get_backend("single", loggers="csv,tensorboard", log_dir=run, monitor={"log_every": 3}) as backend:
        losses = _train(backend, _data(7), log=log)
        assert all(isinstance(t, torch.Tensor) for e in backend.monitor._pending for _, t in e.parts)
        last_pass = backend.monitor.last_pass
    # 7 steps, an interval every 3: the device values were read 3 times (inside steps 3 and 6, and at the
    # pass's end), not 7; each time the calls made since, and the interval's own figures.
    assert reads[:3] == [3, 4, 3] and pending == [1, 2, 1, 2, 3, 1, 2]
    series = read_csv(run)
    assert [s for s, _ in series["loss"]] == list(range(1, 8))
    assert [v for _, v in series["loss"]] == pytest.approx(losses, rel=1e-6)  # the loss read as float32 here
    assert {v for _, v in series["lr"]} == {0.1} and {v for _, v in series["flag"]} == {1.0}
    assert [s for s, _ in series["throughput/samples_per_s"]] == [3, 6, 7]
    # The pass's figures: its three intervals as one.
    wall = dict(series["time/interval_s"])
    rate = dict(series["throughput/samples_per_s"])
    assert last_pass["time/interval_s"] == pytest.approx(sum(wall.values()))
    assert last_pass["throughput/samples_per_s"] == pytest.approx(7 * 4 / sum(wall.values()))
    assert last_pass["throughput/samples_per_s"] == pytest.approx(
        sum(rate[s] * wall[s] for s in wall) / sum(wall.values())
    )
    assert last_pass["time/step_s"] == pytest.approx(sum(wall.values()) / 7)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(run.rglob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx(losses, rel=1e-6)
    assert "hyperparameters/text_summary" in acc.Tags()["tensors"]  # the table of the options
    params = json.loads((run / "hparams.json").read_text())
    assert params["parallelx/backend"] == "single" and params["parallelx/monitor/log_every"] == 3


def test_without_a_logger_log_metrics_keeps_nothing():
    with parallelx.get_backend("single") as backend:
        assert not backend.monitor.active
        backend.log_metrics({"loss": torch.tensor(1.0)}, reduce="mean")
        assert backend.monitor._pending == []


def test_log_metrics_rejects_what_it_cannot_write(tmp_path):
    with parallelx.get_backend("single", loggers="csv", log_dir=tmp_path) as backend:
        with pytest.raises(ParallelxError, match="'v' is a tensor of 3 elements"):
            backend.log_metrics({"v": torch.ones(3)})
        with pytest.raises(ParallelxError, match="'s' is str 'x'; expected a number"):
            backend.log_metrics({"s": "x"})
        with pytest.raises(ParallelxError, match="unknown reduce op 'avg'"):
            backend.log_metrics({"a": 1.0}, reduce="avg")
        with pytest.raises(ParallelxError, match="reduce names 'b', which this call does not log"):
            backend.log_metrics({"a": 1.0}, reduce={"b": "mean"})
    backend = parallelx.get_backend("single", loggers="csv", log_dir=tmp_path)
    with pytest.raises(ParallelxError, match="needs an initialised backend"):
        backend.log_metrics({"a": 1.0})


# ------------------------------------------------------------------ several ranks (threads)
def test_reduced_values_are_reduced_and_rank_0_alone_writes(tmp_path):
    world, meeting, errors = 3, Meeting(3), []
    backends = [
        ThreadBackend(meeting, r, loggers="csv", log_dir=tmp_path / f"rank{r}", monitor={"count_flops": False})
        for r in range(world)
    ]

    def rank_main(b: ThreadBackend) -> None:
        try:
            b.init()
            for step in (1, 2):
                mine = torch.tensor(float(b.rank + step))
                b.log_metrics(
                    {"mean": mine, "max": mine, "sum": float(b.rank), "own": mine},
                    step=step,
                    reduce={"mean": "mean", "max": "max", "sum": "sum"},
                )
            _train(b, _data(2), log=lambda bk, loss: None)  # a pass: its end is an interval, every rank together
            b.shutdown()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(b,)) for b in backends]
    with no_forensics():
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    series = read_csv(tmp_path / "rank0")
    assert series["mean"] == [(1, 2.0), (2, 3.0)]  # mean of 1,2,3 and of 2,3,4
    assert series["max"] == [(1, 3.0), (2, 4.0)]
    assert series["sum"] == [(1, 3.0), (2, 3.0)]
    assert series["own"] == [(1, 1.0), (2, 2.0)]  # not reduced: rank 0's own
    assert not (tmp_path / "rank1").exists() and not (tmp_path / "rank2").exists()  # one writer
    # Throughput summed over the ranks: 3 ranks x 2 batches x 4 samples in the pass.
    wall, rate = dict(series["time/interval_s"]), dict(series["throughput/samples_per_s"])
    assert rate[2] * wall[2] == pytest.approx(24)
    assert dict(series["throughput/samples_per_s_per_rank"])[2] == pytest.approx(rate[2] / 3)


# ------------------------------------------------------------------ options, errors, plug-ins
def test_command_line_options_reach_the_monitor_and_bad_ones_fail(capsys):
    parser = parallelx.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            *("--backend", "single", "--logger", "tensorboard,csv,csv", "--logger-dir", "d", "--logger-every", "5"),
            *("--peak-tflops", "100", "--tokens-per-sample", "512", "--profile-steps", "2:3", "--memory-snapshot"),
        ]
    )
    backend = parallelx.from_args(args)
    o = backend.monitor.options
    assert o.loggers == ("tensorboard", "csv") and o.log_dir == Path("d") and o.log_every == 5
    assert (o.peak_tflops, o.tokens_per_sample, o.profile_steps, o.memory_snapshot) == (100.0, 512, (2, 3), True)
    assert backend.monitor._hyperparams["loggers"] == "('tensorboard', 'csv')"  # the parsed arguments, for the trackers
    # A script's own choices win over the arguments', field by field.
    mine = parallelx.from_args(args, monitor={"throughput": True, "log_every": 7}, accumulate=2)
    o = mine.monitor.options
    assert (o.throughput, o.log_every, o.loggers, mine.options.accumulate) == (True, 7, ("tensorboard", "csv"), 2)
    for bad, says in (
        ("--logger tensorbord", "unknown logger 'tensorbord'; valid loggers are: csv, tensorboard, mlflow, wandb"),
        ("--logger-every 0", "must be an integer >= 1"),
        ("--peak-tflops -1", "must be a finite number > 0"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad.split())
        assert says in capsys.readouterr().err
    with pytest.raises(ParallelxError, match="unknown logger 'tensorbord'; valid loggers are: csv, tensorboard"):
        parallelx.get_backend("single", loggers="tensorbord")
    with pytest.raises(ParallelxError, match=r"profile steps 3:2 .* expected 1 <= A <= B"):
        parallelx.get_backend("single", monitor={"profile_steps": "3:2"})
    with pytest.raises(ParallelxError, match="must look like A:B"):
        parallelx.get_backend("single", monitor={"profile_steps": "2-3"})
    with pytest.raises(ParallelxError, match="unknown monitor option"):
        parallelx.get_backend("single", monitor={"log_evry": 3})
    assert MonitorOptions(profile_steps="4").profile_steps == (4, 4)


def test_a_missing_package_fails_at_start_up_with_its_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ParallelxError, match=r"logger 'mlflow' cannot run: .*pip install 'parallelx\[trackers\]'"):
        parallelx.get_backend("single", loggers="csv,mlflow")


class MemoryTracker(Tracker):
    name = "memory"
    seen: ClassVar[list[tuple[str, Any]]] = []

    def open(self) -> None:
        self.seen.append(("open", self.run_dir))

    def log_hyperparams(self, params: Any) -> None:
        self.seen.append(("hyperparams", dict(params)))

    def log_metrics(self, metrics: Any, step: int, wall_time: float) -> None:
        self.seen.append(("metrics", (step, dict(metrics))))

    def close(self, *, failed: bool = False) -> None:
        self.seen.append(("close", failed))


class _EntryPoint:
    name, value = "fromplugin", f"{__name__}:MemoryTracker"


def test_third_party_trackers_by_registration_and_entry_point(tmp_path, monkeypatch):
    monkeypatch.setattr(
        registry, "entry_points", lambda group: [_EntryPoint()] if group == "parallelx.trackers" else []
    )
    register_tracker("memory", MemoryTracker)
    try:
        assert "fromplugin" in parallelx.observability.available_trackers()
        assert registry.tracker_class("fromplugin") is MemoryTracker
        MemoryTracker.seen.clear()
        with parallelx.get_backend("single", loggers="memory", log_dir=tmp_path, monitor={"throughput": False}) as b:
            b.monitor.log_hyperparams({"lr": 0.5})
            b.log_metrics({"a": torch.tensor(2.0)}, step=7)
        kinds = [k for k, _ in MemoryTracker.seen]
        assert kinds == ["open", "hyperparams", "metrics", "close"]
        assert MemoryTracker.seen[1][1]["lr"] == 0.5 and MemoryTracker.seen[2][1] == (7, {"a": 2.0})
        assert MemoryTracker.seen[3][1] is False
        # A run that fails: what rank 0 logged is still written, and the tracker hears of the failure.
        MemoryTracker.seen.clear()
        with (
            pytest.raises(RuntimeError, match="diverged"),
            parallelx.get_backend("single", loggers="memory", log_dir=tmp_path) as b,
        ):
            b.log_metrics({"a": torch.tensor(3.0)}, step=1)
            raise RuntimeError("diverged")
        assert [k for k, _ in MemoryTracker.seen] == ["open", "hyperparams", "metrics", "close"]
        assert MemoryTracker.seen[2][1] == (1, {"a": 3.0}) and MemoryTracker.seen[3][1] is True
    finally:
        _REGISTERED.pop("memory", None)


def test_a_tracker_that_fails_to_open_stops_the_run_with_why(tmp_path):
    class Broken(MemoryTracker):
        name = "broken"

        def open(self) -> None:
            raise OSError("no route to host")

    register_tracker("broken", Broken)
    try:
        failing = pytest.raises(ParallelxError, match="logger 'broken' could not start .* OSError: no route to host")
        with failing, parallelx.get_backend("single", loggers="broken", log_dir=tmp_path) as b:
            b.log_metrics({"a": 1.0})
            b.monitor.flush()  # the trackers open in their thread: the loop goes on meanwhile
            deadline = time.monotonic() + 10
            while b.monitor._writer.error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            b.log_metrics({"a": 2.0})
            b.monitor.flush()  # the next write says why
    finally:
        _REGISTERED.pop("broken", None)


# ------------------------------------------------------------------ throughput
class _Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throughput_formulas_on_a_clock_driven_by_hand(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    sums: list[list[float]] = []
    meter = throughput.StepMeter(
        torch.device("cpu"),
        world_size=2,
        reduce_sum=lambda t: (sums.append(t.tolist()), t * 2)[1],  # two ranks that did the same
        peak=1e9,
        tokens_per_sample=10,
        count_flops=False,
    )
    meter.flops_per_sample = 1000.0
    meter.pass_start()
    for _ in range(2):  # 2 optimizer steps of 2 micro-batches of 8 samples
        for _ in range(2):
            meter.requested()
            clock.now += 0.1  # waiting for data
            meter.ready((torch.zeros(8, 3), torch.zeros(8)))
            clock.now += 0.3  # forward and backward
            meter.backward_done()
        clock.now += 0.2  # the optimizer step
        meter.step_done()
    out = meter.interval()
    # This rank's samples, wall, data, forward+backward, optimizer seconds, FLOPs, "samples unknown".
    assert len(sums) == 1 and sums[0] == pytest.approx([32, 2.0, 0.4, 1.2, 0.4, 32_000, 0])
    assert out is not None
    assert out["time/interval_s"] == pytest.approx(2.0)
    assert out["time/step_s"] == pytest.approx(1.0)
    assert out["time/data_s"] == pytest.approx(0.2)  # per optimizer step: 2 waits of 0.1
    assert out["time/forward_backward_s"] == pytest.approx(0.6)
    assert out["time/optimizer_s"] == pytest.approx(0.2)
    assert out["throughput/samples_per_s"] == pytest.approx(64 / 2.0)  # both ranks' samples over the interval
    assert out["throughput/samples_per_s_per_rank"] == pytest.approx(16)
    assert out["throughput/tokens_per_s"] == pytest.approx(320)
    assert out["throughput/flops_per_s"] == pytest.approx(64_000 / 2.0)
    assert out["throughput/mfu"] == pytest.approx(16_000 / 1e9)
    clock.now += 5  # nothing trained since: no interval
    assert meter.interval() is None


def test_lenet_flops_equal_the_analytic_count_of_its_layers():
    model, x = LeNet(), torch.randn(3, 3, 32, 32)
    layers: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [m.register_forward_hook(lambda m, i, o: layers.append((m, o))) for m in model.modules()]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    forward = 0
    first_conv = None
    for m, out in layers:
        if isinstance(m, nn.Conv2d):
            flops = 2 * out.numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
            first_conv = flops if first_conv is None else first_conv
            forward += flops
        elif isinstance(m, nn.Linear):
            forward += 2 * out.numel() * m.in_features
    assert forward == 3 * 1_284_000  # 705,600 + 480,000 + 96,000 + 2,400 per image
    assert throughput.module_flops(model, x, backward=False) == forward
    # Backward: the gradient of every layer's input and of its weight, each the forward's
    # cost, except the first convolution's input (the images need no gradient).
    assert throughput.module_flops(model, x) == 3 * forward - first_conv == 3 * 3_146_400

    # The meter counts the same in the training loop, once, on the first micro-batch.
    with parallelx.get_backend("single", monitor={"throughput": True}) as backend:
        net = LeNet()
        model, opt = backend.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        data = [(torch.randn(5, 3, 32, 32), torch.randint(0, 10, (5,))) for _ in range(2)]
        for xb, yb in backend.batches(data):
            backend.backward(nn.functional.cross_entropy(model(xb), yb))
            backend.step(opt)
        assert backend.monitor.meter.flops_per_sample == 3_146_400
        assert backend.monitor.latest["throughput/flops_per_s"] > 0 and "throughput/mfu" not in backend.monitor.latest
    # A figure given instead of counted, and a peak: MFU.
    with parallelx.get_backend("single", monitor={"throughput": True, "flops_per_sample": 1e6, "peak_tflops": 1}) as b:
        net = LeNet()
        model, opt = b.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for xb, yb in b.batches(data):
            b.backward(nn.functional.cross_entropy(model(xb), yb))
            b.step(opt)
        latest = b.monitor.latest
        assert latest["throughput/flops_per_s"] == pytest.approx(1e6 * latest["throughput/samples_per_s"])
        assert latest["throughput/mfu"] == pytest.approx(latest["throughput/flops_per_s"] / 1e12)


@pytest.mark.parametrize(
    "name,precision,expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.5e12),
        ("NVIDIA H100 PCIe", "16-mixed", 756.5e12),
        ("NVIDIA H200", "bf16-mixed", 989.5e12),
        ("NVIDIA A100-SXM4-80GB", "32", 19.5e12),
        ("NVIDIA L40S", "bf16-mixed", 366.5e12),
        ("NVIDIA L4", "bf16-mixed", 121e12),
        ("NVIDIA A10G", "bf16-mixed", 70e12),
        ("Tesla V100-SXM2-16GB", "16-mixed", 125e12),
        ("AMD Instinct MI300X", "bf16-mixed", 1307.4e12),
        ("Tesla V100-SXM2-16GB", "bf16-mixed", None),  # no bfloat16 tensor cores
        ("Some Future GPU", "bf16-mixed", None),
    ],
)
def test_peak_flops_from_the_table(monkeypatch, name, precision, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, why = throughput.peak_flops(torch.device("cuda", 0), precision)
    assert peak == expected, why
    if expected is None:
        assert "--peak-tflops" in why
    assert throughput.peak_flops(torch.device("cuda", 0), precision, 42.0)[0] == 42e12  # the user's value wins


def test_peak_flops_on_the_cpu_says_mfu_needs_a_peak():
    peak, why = throughput.peak_flops(torch.device("cpu"), "32")
    assert peak is None and "no peak FLOP/s is known for the cpu; give --peak-tflops" in why


# ------------------------------------------------------------------ profiles
def test_profile_steps_write_a_trace_that_loads_as_json(tmp_path, capsys):
    with parallelx.get_backend("single", log_dir=tmp_path, monitor={"profile_steps": "2:3"}) as backend:
        _train(backend, _data(5))
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step 2", "step 3"} <= names and not {"step 1", "step 4"} & names
    out = capsys.readouterr().out
    assert out.count("profile of optimizer steps 2:3") == 1 and "aten::addmm" in out


def test_profile_past_the_last_step_says_nothing_was_profiled(tmp_path, capsys):
    with parallelx.get_backend("single", log_dir=tmp_path, monitor={"profile_steps": "9:10"}) as backend:
        _train(backend, _data(2))
    assert "the run made fewer steps; nothing was profiled" in capsys.readouterr().err
    assert not (tmp_path / "profile").exists()
