"""Throughput, the step time split, achieved FLOP/s and MFU, per logging interval.

:class:`StepMeter` is told where the training loop is (``parallelx.parts.loop``
marks four points of every micro-batch: batch asked for, batch handed out,
backward done, optimizer step done) and turns the marks of one interval into
figures.  On a GPU the forward/backward and optimizer spans are CUDA events
recorded on the current stream and read once, at the end of the interval: no
host synchronisation per step.  Waiting for data is host time (the loader
runs on the host).

The FLOPs of a training micro-batch (forward, loss and backward) are counted
once, on the first micro-batch of the first pass, with
``torch.utils.flop_counter.FlopCounterMode`` around the real computation:
whatever wraps or shards the model (DDP, FSDP2's ``fully_shard``, a DeepSpeed
engine at any ZeRO stage, Horovod's hooks), the operations that run are the
ones counted, on each rank's own micro-batch.  Communication and the
optimizer's update are not FLOPs of the model and are not counted (the
usual definition of model FLOPs utilisation).

The formulas (``n``: processes; per rank, then summed over the ranks with one
all-reduce per interval)::

    samples/s          = sum of the ranks' samples / interval wall time (mean over ranks)
    tokens/s           = samples/s x tokens per sample          (when the script says it)
    FLOP/s             = FLOPs per sample x samples / interval wall time
    MFU                = FLOP/s per rank / peak FLOP/s of one device
    step time split    = per optimizer step, mean over the ranks: data wait,
                         forward+backward (with the gradient communication that
                         overlaps it), optimizer step (with its communication)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # it imports triton where torch has it (0.2 s): loaded when FLOPs are first counted
    from torch.utils.flop_counter import FlopCounterMode

#: Dense (no 2:4 sparsity) peak TFLOP/s of one device, per compute type, from
#: the vendors' data sheets (they print the sparse figure for tensor cores:
#: the dense one is half of it).  ``fp32`` is the plain (non-tensor-core)
#: figure, ``tf32`` the tensor-core one used for float32 matmuls when torch
#: allows TF32 (``torch.backends.cuda.matmul.fp32_precision`` / ``set_float32_matmul_precision``).
#: Patterns are tried in order against the lower-cased ``torch.cuda.get_device_name()``.
#:
#: - H200 SXM / NVL: NVIDIA H200 Tensor Core GPU data sheet (2024): FP32 67 / 60, TF32 989 / 835,
#:   BF16 and FP16 1,979 / 1,671 TFLOPS with sparsity.
#: - H100 SXM / NVL / PCIe: NVIDIA H100 Tensor Core GPU data sheet (2023): FP32 67 / 60 / 51,
#:   TF32 989 / 835 / 756, BF16 and FP16 1,979 / 1,671 / 1,513 TFLOPS with sparsity.
#: - A100 (SXM and PCIe, 40 and 80 GB): NVIDIA A100 Tensor Core GPU data sheet (2021): FP32 19.5,
#:   TF32 156, BF16 and FP16 312 TFLOPS dense.
#: - L40S: NVIDIA L40S data sheet (2023): FP32 91.6, TF32 366, BF16 and FP16 733 TFLOPS with sparsity.
#: - L4: NVIDIA L4 Tensor Core GPU data sheet (2023): FP32 30.3, TF32 120, BF16 and FP16 242 TFLOPS with sparsity.
#: - A10: NVIDIA A10 Tensor Core GPU data sheet (2021): FP32 31.2, TF32 125, BF16 and FP16 250 TFLOPS with sparsity.
#: - A10G: NVIDIA A10G data sheet for Amazon EC2 G5 (2022): FP32 35, BF16 and FP16 tensor 70 TFLOPS dense.
#: - T4: NVIDIA T4 data sheet (2019): FP32 8.1, FP16 65 TFLOPS (no BF16).
#: - V100S / V100 SXM2 / V100 PCIe: NVIDIA V100 data sheet (2020): FP32 16.4 / 15.7 / 14,
#:   tensor (FP16) 130 / 125 / 112 TFLOPS (no BF16, no TF32).
#: - MI300X and MI325X: AMD Instinct MI300X / MI325X data sheets (2023, 2024): FP32 matrix 163.4,
#:   TF32 653.7, BF16 and FP16 1,307.4 TFLOPS dense.
#: - MI250X: AMD Instinct MI250X data sheet (2021): FP32 matrix 95.7, BF16 and FP16 383 TFLOPS.
PEAK_TFLOPS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H200 NVL", r"h200.*nvl", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H200 SXM", r"h200", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    ("H100 NVL", r"h100.*nvl", {"fp32": 60, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    ("H100 PCIe", r"h100.*pcie", {"fp32": 51, "tf32": 378, "bf16": 756.5, "fp16": 756.5}),
    ("H100 SXM", r"h100", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}),
    ("A100", r"a100", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}),
    ("L40S", r"l40s", {"fp32": 91.6, "tf32": 183, "bf16": 366.5, "fp16": 366.5}),
    ("L4", r"\bl4\b", {"fp32": 30.3, "tf32": 60, "bf16": 121, "fp16": 121}),
    ("A10G", r"\ba10g\b", {"fp32": 35, "bf16": 70, "fp16": 70}),
    ("A10", r"\ba10\b", {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125}),
    ("T4", r"\bt4\b", {"fp32": 8.1, "fp16": 65}),
    ("V100S", r"v100s", {"fp32": 16.4, "fp16": 130}),
    ("V100 PCIe", r"v100.*pcie", {"fp32": 14, "fp16": 112}),
    ("V100 SXM2", r"v100", {"fp32": 15.7, "fp16": 125}),
    ("MI300X", r"mi3(00|25)x", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4}),
    ("MI250X", r"mi250x", {"fp32": 95.7, "bf16": 383, "fp16": 383}),
)

#: The compute type of each ``precision`` (parallelx.parts.loop.PRECISIONS).
_COMPUTE = {"bf16-mixed": "bf16", "16-mixed": "fp16", "bf16-compute": "bf16"}


def _float32_compute() -> str:
    """``tf32`` where torch lets float32 matmuls run on tensor cores, else ``fp32``."""
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak_flops(device: torch.device, precision: str, user_tflops: float | None = None) -> tuple[float | None, str]:
    """Peak FLOP/s of one ``device`` for ``precision`` (``32``, ``bf16-mixed``,
    ``16-mixed``), and where the figure comes from; ``(None, why)`` when it is
    unknown (the CPU, a GPU not in :data:`PEAK_TFLOPS`, a type it lacks).
    ``user_tflops`` (``--peak-tflops``) wins over the table."""
    if user_tflops is not None:
        return user_tflops * 1e12, f"--peak-tflops {user_tflops:g}"
    if device.type != "cuda":
        return None, f"no peak FLOP/s is known for the {device.type}; give --peak-tflops to get MFU"
    name = torch.cuda.get_device_name(device)
    compute = _COMPUTE.get(precision) or _float32_compute()
    for label, pattern, figures in PEAK_TFLOPS:
        if re.search(pattern, name.lower()):
            value = figures.get(compute) or (figures["fp32"] if compute == "tf32" else None)
            if value is None:
                return None, f"{label} has no {compute} tensor cores in the table; give --peak-tflops to get MFU"
            return value * 1e12, f"{label} {compute} dense peak ({value:g} TFLOP/s, vendor data sheet)"
    return None, f"{name!r} is not in parallelx.observability.throughput.PEAK_TFLOPS; give --peak-tflops to get MFU"


def combine(intervals: list[dict[str, float]], world_size: int, peak: float | None) -> dict[str, float]:
    """The figures of several intervals (a whole pass) as if they were one: rates over the
    summed wall time, time parts weighted by each interval's optimizer steps."""
    wall = sum(f["time/interval_s"] for f in intervals)
    steps = sum(f["time/interval_s"] / f["time/step_s"] for f in intervals)
    if not intervals or wall <= 0:
        return {}
    out = {"time/interval_s": wall, "time/step_s": wall / steps}
    for key in ("time/data_s", "time/forward_backward_s", "time/optimizer_s"):
        out[key] = sum(f[key] * f["time/interval_s"] / f["time/step_s"] for f in intervals) / steps
    for key in ("throughput/samples_per_s", "throughput/tokens_per_s", "throughput/flops_per_s"):
        if all(key in f for f in intervals):
            out[key] = sum(f[key] * f["time/interval_s"] for f in intervals) / wall
            out[f"{key}_per_rank"] = out[key] / world_size
    if peak and "throughput/flops_per_s" in out:
        out["throughput/mfu"] = out["throughput/flops_per_s_per_rank"] / peak
    return out


def samples_in(batch: Any) -> int | None:
    """How many samples ``batch`` holds: the first dimension of its first
    tensor (``(x, y)``, ``{"input_ids": ...}``, a tensor), or None when it has no tensor."""
    while True:
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() > 0 else 1
        if isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return None


def count_flops(fn: Callable[[], Any]) -> int:
    """The FLOPs of what ``fn()`` computes (run it with the real tensors, or
    on the ``meta`` device to count without computing), as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them: a multiply-add
    is 2 FLOPs; matmuls, convolutions and attention are counted, elementwise
    operations are not.  Put the backward inside ``fn`` to count it too::

        flops = count_flops(lambda: loss_fn(model(x), y).backward())
    """
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def module_flops(model: nn.Module, inputs: torch.Tensor, *, backward: bool = True) -> int:
    """The FLOPs of one forward (and backward, by default) of ``model`` on
    ``inputs``; the backward is that of ``output.sum()``."""
    if backward:
        return count_flops(lambda: model(inputs).sum().backward())
    with torch.no_grad():
        return count_flops(lambda: model(inputs))


class _HostClock:
    """Stamps are ``time.perf_counter()`` values (the CPU: work is done when the call returns)."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start

    def wait(self, stamp: Any) -> None:
        pass

    def reset(self) -> None:
        pass


class _CudaClock:
    """Stamps are CUDA events on the current stream, from a pool reused every
    interval: recording one does not wait for the GPU; :meth:`wait` (once per
    interval) does."""

    def __init__(self) -> None:
        self._pool: list[torch.cuda.Event] = []
        self._used = 0

    def stamp(self) -> torch.cuda.Event:
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0

    def wait(self, stamp: torch.cuda.Event) -> None:
        stamp.synchronize()

    def reset(self) -> None:
        self._used = 0


class StepMeter:
    """The marks of one process's training loop, summed per interval.

    ``reduce_sum`` sums a 1-D float64 CPU tensor over the ranks (the backend's
    all-reduce; identity in a world of one).  Every rank calls the marks in
    the same order and :meth:`interval` at the same points (the end of an
    optimizer step, the end of a pass): the loop is in lockstep there.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        world_size: int,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        peak: float | None,
        tokens_per_sample: int | None = None,
        count_flops: bool = True,
        readers: int = 1,
    ) -> None:
        self.world_size = world_size
        #: How many ranks read each sample (a tensor-parallel group): the summed samples counted once.
        self.readers = readers
        self.reduce_sum = reduce_sum
        self.peak = peak
        self.tokens_per_sample = tokens_per_sample
        self.clock: _HostClock | _CudaClock = _CudaClock() if device.type == "cuda" else _HostClock()
        #: FLOPs of one sample's forward+backward (None until counted; 0 when counting is off or failed).
        self.flops_per_sample: float | None = None if count_flops else 0.0
        self.flops_per_micro_batch: float = 0.0
        self._counter: FlopCounterMode | None = None
        self._counted_samples: int | None = None
        self._unknown_samples = False
        self._reset(time.perf_counter())

    def _reset(self, start: float) -> None:
        self.clock.reset()
        self._start = start
        self._paused: float | None = None
        self._asked: float | None = None
        self._ready: Any = None
        self._last_backward: Any = None
        self._last_stamp: Any = None
        self.samples = 0
        self.micro_batches = 0
        self.steps = 0
        self._data_s = 0.0
        self._spans_fb: list[tuple[Any, Any]] = []
        self._spans_opt: list[tuple[Any, Any]] = []

    # ------------------------------------------------------------ the marks
    def pass_start(self) -> None:
        """A pass over the loader begins; time between passes (evaluation) is not counted."""
        now = time.perf_counter()
        if self.steps == 0 and self.micro_batches == 0:
            self._start = now
        elif self._paused is not None:
            self._start += now - self._paused
        self._paused = None

    def pass_paused(self) -> None:
        """The pass ended without closing the interval (left early): stop its clock until the next pass."""
        self._paused = time.perf_counter()
        self._stop_counting()

    def requested(self) -> None:
        self._stop_counting()  # a forward without backward (evaluation) since: do not count it
        self._asked = time.perf_counter()

    def ready(self, batch: Any) -> None:
        now = time.perf_counter()
        if self._asked is not None:
            self._data_s += now - self._asked
            self._asked = None
        n = samples_in(batch)
        if n is None:
            self._unknown_samples = True
        else:
            self.samples += n
        self.micro_batches += 1
        self._ready = self._last_stamp = self.clock.stamp()
        if self.flops_per_sample is None and self._counter is None:
            self._counted_samples = n
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def backward_done(self) -> None:
        self._last_backward = self._last_stamp = self.clock.stamp()
        if self._ready is not None:
            self._spans_fb.append((self._ready, self._last_backward))
            self._ready = None
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            flops = float(counter.get_total_flops())
            self.flops_per_micro_batch = flops
            self.flops_per_sample = flops / self._counted_samples if self._counted_samples else 0.0

    def step_done(self) -> None:
        end = self._last_stamp = self.clock.stamp()
        if self._last_backward is not None:
            self._spans_opt.append((self._last_backward, end))
            self._last_backward = None
        self.steps += 1

    def _stop_counting(self) -> None:
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)

    def close(self) -> None:
        """Leave the FLOP counter if a failure interrupted the counted micro-batch."""
        self._stop_counting()

    # ------------------------------------------------------------ the figures
    def interval(self) -> dict[str, float] | None:
        """Close the interval: its figures (None when no optimizer step was
        made in it), and start the next.  Reads the GPU's events (one wait)
        and sums over the ranks (one all-reduce): every rank calls it together."""
        if self.steps == 0:
            self._reset(time.perf_counter())
            return None
        if self._last_stamp is not None:
            self.clock.wait(self._last_stamp)
        now = time.perf_counter()
        wall = now - self._start
        fb = sum(self.clock.seconds(a, b) for a, b in self._spans_fb)
        opt = sum(self.clock.seconds(a, b) for a, b in self._spans_opt)
        per_sample = self.flops_per_sample or 0.0
        flops = per_sample * self.samples if per_sample else self.flops_per_micro_batch * self.micro_batches
        mine = [self.samples, wall, self._data_s, fb, opt, flops, float(self._unknown_samples)]
        steps = self.steps
        self._reset(now)
        total = self.reduce_sum(torch.tensor(mine, dtype=torch.float64)).tolist()
        samples, wall_sum, data, fb, opt, flops, unknown = total
        samples /= self.readers  # each rank's FLOPs are its own (a split layer's share): summed as they are
        n = self.world_size
        wall = wall_sum / n  # every rank's interval spans the same steps: their mean is the job's
        out: dict[str, float] = {
            "time/interval_s": wall,
            "time/step_s": wall / steps,
            "time/data_s": data / n / steps,
            "time/forward_backward_s": fb / n / steps,
            "time/optimizer_s": opt / n / steps,
        }
        if not unknown:
            out["throughput/samples_per_s"] = samples / wall
            out["throughput/samples_per_s_per_rank"] = samples / wall / n
            if self.tokens_per_sample:
                out["throughput/tokens_per_s"] = samples * self.tokens_per_sample / wall
                out["throughput/tokens_per_s_per_rank"] = samples * self.tokens_per_sample / wall / n
        if flops > 0:
            out["throughput/flops_per_s"] = flops / wall
            out["throughput/flops_per_s_per_rank"] = flops / wall / n
            if self.peak:
                out["throughput/mfu"] = flops / wall / n / self.peak
        return out
