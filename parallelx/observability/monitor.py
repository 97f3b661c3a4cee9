"""The monitor: ``backend.log_metrics``, the loop's marks, and the trackers behind them.

One per backend (``backend.monitor``).  What a metric goes through:

1. ``backend.log_metrics({"loss": loss, "lr": lr}, step=step, reduce=...)`` on
   every rank.  Numbers are kept as they are; tensors (one element each) are
   copied on their device into one float64 tensor per call: nothing waits for
   the GPU.  A rank other than 0 keeps only the values it must help reduce.
2. At the end of a logging interval (every ``log_every`` optimizer steps, the
   end of a pass over the loader, ``flush()``, shutdown) the kept tensors are
   read in one transfer per device, the values asked for are reduced across
   the ranks in one all-reduce per reduce operation, and rank 0 hands the
   numbers to its writer thread.
3. The writer thread (rank 0 only) opens the trackers once, writes the
   hyperparameters once, then every batch of metrics to every tracker; the
   training loop never waits for a file or a server.

The loop's marks (:class:`parallelx.parts.loop.TrainingLoop` calls ``pass_start``,
``requested``, ``ready``, ``backward_done``, ``step_done``, ``pass_end``)
drive the throughput meter (:mod:`parallelx.observability.throughput`), the profiler
(:mod:`parallelx.observability.profiling`) and the logging intervals.  With nothing asked
for (no logger, no throughput, no profile) each mark returns at once.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from parallelx import storage
from parallelx.errors import ParallelxError
from parallelx.log import info, warn
from parallelx.observability.mirror import Mirror
from parallelx.observability.options import MonitorOptions
from parallelx.observability.profiling import StepProfiler
from parallelx.observability.throughput import StepMeter, combine, peak_flops
from parallelx.observability.trackers.catalog import check_available, tracker_class
from parallelx.observability.trackers.tracker import Tracker, flat_params
from parallelx.parts.collectives import Collectives
from parallelx.parts.loop import LoopOptions
from parallelx.settings import check_op


class World(Protocol):
    """Where the watched process stands (:class:`parallelx.strategy.Joined` is one)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def comm(self) -> Collectives: ...


class WatchedRun(Protocol):
    """What the monitor reads of the run it watches (:class:`parallelx.strategy.Run` is one): it holds
    the run's record, never the facade."""

    name: str
    options: LoopOptions
    #: Where this process stands in the data x tensor-parallel grid (None before init).
    mesh: Any

    @property
    def joined(self) -> World | None: ...


#: How long shutdown waits for the writer thread to write what is left and close the trackers.
CLOSE_TIMEOUT_S = 120.0

Reduce = str | Mapping[str, str | None] | None
#: The reduce operation of a value that a failed run could not reduce (it is not written).
_DROPPED = "dropped"


@dataclass
class _Entry:
    """One ``log_metrics`` call, until it is written."""

    step: int
    wall_time: float
    names: list[str]
    values: list[float]  # the numbers; nan where the value is in a tensor part, until read
    parts: list[tuple[int, torch.Tensor]]  # (position in names, a one-element copy on the device)
    ops: list[str | None]  # the reduce operation of each name


class Monitor:
    """Trackers, throughput and profiles of one backend (see the module's docstring)."""

    def __init__(self, run: WatchedRun, options: MonitorOptions) -> None:
        self.run = run
        self.options = options
        check_available(options.loggers)  # a missing package fails here, at start-up, with its pip command
        self.active = options.active
        #: Optimizer steps the loop has made (all passes).
        self.steps = 0
        #: The figures of the last interval (``throughput/samples_per_s``, ``time/step_s``, ...), on every rank.
        self.latest: dict[str, float] = {}
        #: The same figures over the whole last pass of ``backend.batches`` (an epoch), on every rank.
        self.last_pass: dict[str, float] = {}
        self._pass_intervals: list[dict[str, float]] = []
        self._pass_open = False
        self.meter: StepMeter | None = None
        self.profiler: StepProfiler | None = None
        self._started = False
        self._pending: list[_Entry] = []
        self._hyperparams: dict[str, Any] = {}
        #: A run directory in a store: the local folder the files are written to first, copied there.
        log_dir = options.log_dir
        self._mirror = Mirror(log_dir) if isinstance(log_dir, str) else None
        self._run_dir: Path | None = log_dir if isinstance(log_dir, Path) else None
        self._writer: _Writer | None = None
        self._closed = False

    # ------------------------------------------------------------ the run directory
    @property
    def run_dir(self) -> Path:
        """Where the trackers and the profiles write: ``log_dir``, or a new ``runs/<date>-<time>``."""
        if self._run_dir is None and self._mirror is not None:
            self._run_dir = self._mirror.make_local()
        if self._run_dir is None:
            base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
            path, n = base, 1
            while path.exists():
                n += 1
                path = base.with_name(f"{base.name}-{n}")
            self._run_dir = path
        return self._run_dir

    @property
    def _world(self) -> World:
        joined = self.run.joined
        if joined is None:
            raise ParallelxError("the monitor needs an initialised backend: call it inside `with backend:`")
        return joined

    # ------------------------------------------------------------ logging
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None, reduce: Reduce = None) -> None:
        """See :meth:`parallelx.Backend.log_metrics`."""
        if not self.options.loggers:
            return
        if self.run.joined is None:
            raise ParallelxError(
                "log_metrics needs an initialised backend (it writes on rank 0 only): call it inside `with backend:`"
            )
        if not isinstance(metrics, Mapping):
            raise ParallelxError(f"log_metrics takes a dict of name -> value, got {type(metrics).__name__}")
        ops = _reduce_ops(metrics, reduce)
        main = self._world.rank == 0
        names: list[str] = []
        values: list[float] = []
        kept_ops: list[str | None] = []
        parts: list[tuple[int, torch.Tensor]] = []
        for (name, value), op in zip(metrics.items(), ops):
            if not isinstance(name, str):
                raise ParallelxError(f"log_metrics: metric names must be strings, got {name!r}")
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ParallelxError(
                        f"log_metrics: {name!r} is a tensor of {value.numel()} elements; log one value "
                        "(e.g. its .mean()) or one metric per element"
                    )
                if not main and op is None:
                    continue
                # A copy on the tensor's device (asynchronous there): the caller may change its tensor afterwards.
                parts.append((len(names), value.detach().clone()))
                values.append(math.nan)
            else:
                try:
                    number = float(value)
                except (TypeError, ValueError):
                    raise ParallelxError(
                        f"log_metrics: {name!r} is {type(value).__name__} {value!r}; expected a number or a "
                        "one-element tensor"
                    ) from None
                if not main and op is None:
                    continue
                values.append(number)
            names.append(name)
            kept_ops.append(op)
        if names:
            entry = _Entry(self.steps if step is None else int(step), time.time(), names, values, parts, kept_ops)
            self._pending.append(entry)

    def log_hyperparams(self, params: Mapping[str, Any] | Any) -> None:
        """Record ``params`` (a dict, or an ``argparse.Namespace``) with the
        run, on rank 0.  Called before training, they are written with the
        backend's own options when the trackers open; later, at once."""
        values = flat_params(vars(params) if not isinstance(params, Mapping) else params)
        self._hyperparams.update(values)
        if self._writer is not None:
            self._writer.put(("hyperparams", values))

    def flush(self) -> None:
        """Read what was logged since the last interval, reduce what was asked,
        and hand it to the trackers.  A collective when a value is reduced:
        every rank calls it (the loop does, at every interval)."""
        self._flush(failed=False)

    def _flush(self, *, failed: bool) -> None:
        entries, self._pending = self._pending, []
        if not entries:
            if self._writer is not None:
                self._writer.raise_error()
            return
        _read_device_values(entries)
        dropped = _reduce(entries, self._world, failed=failed)
        if dropped:
            warn(f"{dropped} logged value(s) to be reduced across ranks were not written: the run failed first")
        if self._world.rank == 0:
            batch = [
                (e.step, e.wall_time, {n: v for n, v, op in zip(e.names, e.values, e.ops) if op != _DROPPED})
                for e in entries
            ]
            self._ensure_writer().put(("metrics", batch))

    def wait_written(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until the trackers have written what was handed to them (rank 0;
        at once elsewhere); False if ``timeout`` passed first.  For tests and
        benchmarks: training never needs to wait for them."""
        return self._writer is None or self._writer.wait(timeout)

    def _ensure_writer(self) -> _Writer:
        if self._writer is None:
            run_dir = self.run_dir
            run_dir.mkdir(parents=True, exist_ok=True)
            trackers = [tracker_class(n)(run_dir, self.options.run_name or run_dir.name) for n in self.options.loggers]
            self._writer = _Writer(trackers, self._all_hyperparams(), self._mirror)
            self._writer.start()
        self._writer.raise_error()
        return self._writer

    def _all_hyperparams(self) -> dict[str, Any]:
        w = self._world
        own = {
            "backend": self.run.name,
            "world_size": w.world_size,
            "device": str(w.device),
            **{f"loop/{k}": v for k, v in dataclasses.asdict(self.run.options).items()},
            **{f"monitor/{k}": v for k, v in dataclasses.asdict(self.options).items()},
        }
        return {**flat_params({"parallelx": own}), **self._hyperparams}

    # ------------------------------------------------------------ the loop's marks
    def _start(self) -> None:
        """At the first pass (every rank, after init): the meter, the profiler, the trackers."""
        self._started = True
        b, o = self._world, self.options
        if o.profile_steps is not None and o.log_dir is None and b.world_size > 1:
            # Every rank writes its trace into rank 0's (time-stamped) directory.
            shared = b.comm.broadcast(str(self.run_dir) if b.rank == 0 else None, src=0)
            assert shared is not None  # rank 0 sent its directory
            self._run_dir = Path(shared)
        if o.measures_throughput:
            peak, why = peak_flops(b.device, self.run.options.precision, o.peak_tflops)
            if peak is None and (o.count_flops or o.flops_per_sample):
                warn(f"MFU is not reported: {why}")
            self.meter = StepMeter(
                b.device,
                world_size=b.world_size,
                reduce_sum=lambda t: b.comm.all_reduce(t, "sum") if b.world_size > 1 else t,
                peak=peak,
                tokens_per_sample=o.tokens_per_sample,
                count_flops=o.count_flops and o.flops_per_sample is None,
                readers=self.run.mesh.tp_size if self.run.mesh is not None else 1,
            )
            if o.flops_per_sample is not None:
                self.meter.flops_per_sample = float(o.flops_per_sample)
        if o.profile_steps is not None:
            self.profiler = StepProfiler(
                o.profile_steps,
                rank=b.rank,
                device=b.device,
                out_dir=lambda: self.run_dir,
                memory_snapshot=o.memory_snapshot,
            )
        if o.loggers and b.rank == 0:
            self._ensure_writer()

    def pass_start(self) -> None:
        if not self.active:
            return
        if not self._started:
            self._start()
        self._flush(failed=False)  # what was logged between passes (an evaluation's figures)
        if not self._pass_open:  # a new pass, not one that goes on after a break
            self._pass_intervals, self._pass_open = [], True
        if self.meter is not None:
            self.meter.pass_start()

    def requested(self) -> None:
        if self.meter is not None:
            self.meter.requested()
        if self.profiler is not None:
            self.profiler.step_starting(self.steps + 1)

    def ready(self, batch: Any) -> None:
        if self.meter is not None:
            self.meter.ready(batch)

    def backward_done(self) -> None:
        if self.meter is not None:
            self.meter.backward_done()

    def step_done(self) -> None:
        if not self.active:
            return
        self.steps += 1
        if self.meter is not None:
            self.meter.step_done()
        if self.profiler is not None:
            self.profiler.step_done(self.steps)
        if self.steps % self.options.log_every == 0:
            self._interval()

    def pass_end(self) -> None:
        """The pass ended on every rank (the loader is exhausted): close the interval."""
        if self.active:
            self._interval()
            self._pass_open = False
            if self.meter is not None:
                self.last_pass = combine(self._pass_intervals, self._world.world_size, self.meter.peak)

    def pass_paused(self) -> None:
        """The pass was left (a ``break``, an error): no collective here; the interval goes on at the next pass."""
        if self.meter is not None:
            self.meter.pass_paused()

    def _interval(self) -> None:
        if self.meter is not None and (figures := self.meter.interval()):
            self.latest = figures
            self._pass_intervals.append(figures)
            self.log_metrics(figures, step=self.steps)
        self._flush(failed=False)

    # ------------------------------------------------------------ the end
    def close(self, *, failed: bool = False) -> None:
        """Write what is left and close the trackers (shutdown; ``failed``:
        abort, where no collective may run and nothing may raise).  Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.meter is not None:
                self.meter.close()
                if not failed and self.meter.steps:
                    self._interval()  # an interval left open by a pass that did not end
            if self.profiler is not None:
                self.profiler.close()
            self._flush(failed=failed)
        except Exception as exc:
            if not failed:
                raise
            warn(f"the last metrics could not be written after the failure: {type(exc).__name__}: {exc}")
        finally:
            if self._writer is not None:
                self._writer.close(failed=failed)
            if self._mirror is not None:  # every rank: the trackers' files (rank 0) and its profile traces
                self._mirror.sync(force=True)
            if self._writer is not None and not failed:
                where = storage.show(self._mirror.url) if self._mirror is not None else self.run_dir
                info(f"parallelx: metrics of this run in {where} ({', '.join(self.options.loggers)})")


def _reduce_ops(metrics: Mapping[str, Any], reduce: Reduce) -> list[str | None]:
    """The reduce operation of each metric: ``reduce`` for all, or per name from a dict."""
    if reduce is None or isinstance(reduce, str):
        op = None if reduce is None else check_op(reduce)
        return [op] * len(metrics)
    if not isinstance(reduce, Mapping):
        raise ParallelxError(f"reduce must be None, an operation name or a dict of name -> operation, got {reduce!r}")
    if unknown := sorted(set(reduce) - set(metrics)):
        raise ParallelxError(
            f"reduce names {', '.join(map(repr, unknown))}, which this call does not log; logged: {', '.join(map(repr, metrics))}"
        )
    return [None if reduce.get(n) is None else check_op(str(reduce[n])) for n in metrics]


def _read_device_values(entries: list[_Entry]) -> None:
    """Fill in the tensors' values: one transfer to the host per device for all the entries."""
    by_device: dict[torch.device, list[tuple[_Entry, int, torch.Tensor]]] = {}
    for e in entries:
        for slot, t in e.parts:
            by_device.setdefault(t.device, []).append((e, slot, t))
        e.parts = []
    for items in by_device.values():
        # One concatenation (its dtype promoted over the parts'), one copy to the host: the only wait for the device.
        host = torch.cat([t.reshape(1) for _, _, t in items]).to(torch.float64).cpu().tolist()
        for (e, slot, _), value in zip(items, host):
            e.values[slot] = value


def _reduce(entries: list[_Entry], backend: World, *, failed: bool) -> int:
    """Reduce the values asked for across the ranks, one all-reduce per operation.
    Every rank holds the same reduced names in the same order.  Returns how many were dropped (``failed``)."""
    by_op: dict[str, list[tuple[_Entry, int]]] = {}
    for e in entries:
        for i, op in enumerate(e.ops):
            if op is not None:
                by_op.setdefault(op, []).append((e, i))
    if not by_op or backend.world_size == 1:
        return 0
    if failed:
        dropped = 0
        for slots in by_op.values():
            for e, i in slots:
                e.ops[i] = _DROPPED
                dropped += 1
        return dropped
    for op in sorted(by_op):
        slots = by_op[op]
        reduced = backend.comm.all_reduce(
            torch.tensor([e.values[i] for e, i in slots], dtype=torch.float64), check_op(op)
        ).tolist()
        for (e, i), value in zip(slots, reduced):
            e.values[i] = value
    return 0


class _Writer:
    """Rank 0's thread that opens the trackers and writes to them, so that the
    loop never waits for a file, a database or a server."""

    def __init__(self, trackers: list[Tracker], hyperparams: dict[str, Any], mirror: Mirror | None = None) -> None:
        self.trackers = trackers
        self.hyperparams = hyperparams
        self.mirror = mirror
        self.error: str | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="parallelx-trackers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Any) -> None:
        self.raise_error()
        self._queue.put(item)

    def raise_error(self) -> None:
        if self.error is not None:
            raise ParallelxError(self.error)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, *, failed: bool) -> None:
        self._queue.put(("close", failed))
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            warn(
                f"the trackers did not finish writing within {CLOSE_TIMEOUT_S:.0f} s; their last values may be missing"
            )

    def _run(self) -> None:
        live: list[Tracker] = []
        for tracker in self.trackers:
            try:
                tracker.open()
                tracker.log_hyperparams(self.hyperparams)
                live.append(tracker)
            except Exception as exc:
                self.error = (
                    f"logger {tracker.name!r} could not start in {tracker.run_dir}: {type(exc).__name__}: {exc}"
                )
                print(f"parallelx: error: {self.error}", file=sys.stderr, flush=True)
        while True:
            kind, payload = self._queue.get()
            for tracker in list(live):
                try:
                    if kind == "close":
                        tracker.close(failed=payload)
                    elif kind == "hyperparams":
                        tracker.log_hyperparams(payload)
                    else:
                        _write(tracker, payload)
                except Exception as exc:  # one failing tracker must not stop training or the others
                    warn(f"logger {tracker.name!r} failed and is left out from now on: {type(exc).__name__}: {exc}")
                    live.remove(tracker)
            if kind == "metrics" and self.mirror is not None:
                self.mirror.sync()  # what the trackers wrote, to the store (every so many seconds)
            self._queue.task_done()
            if kind == "close":
                return


def _write(tracker: Tracker, batch: list[tuple[int, float, dict[str, float]]]) -> None:
    for step, wall_time, metrics in batch:
        if metrics:
            tracker.log_metrics(metrics, step, wall_time)
    tracker.flush()
