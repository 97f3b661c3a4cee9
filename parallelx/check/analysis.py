"""What the runs of a check say: differences measured against the script's own
noise floor, and diagnoses that name a likely cause and its fix.

Everything here works on what the runs recorded (:class:`RunResult`: each
rank's JSON record and rank 0's tensors), so it is tested with synthetic
records, without launching anything.

**The tolerance.**  Two correct runs that add the same numbers in another
order drift apart, by an amount that depends on the script (the optimizer,
the precision, the nonlinearities, the number of steps).  The check measures
it: the *floor* run is the reference again with every initial weight moved by
half a float32 rounding (random signs).  A tensor's floor is how far it ends
from the reference in that run; its tolerance is ``factor`` times its floor,
and never less than a few float32 roundings (or, under mixed precision, the
autocast type's rounding).  The gradients are compared at the first step,
before anything has amplified; the loss and the gradient norm at every step;
the weights after the last.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from parallelx.check.report import COULD_NOT_RUN, DIFFERS, SAME, Diff, Finding, Report, Row, fmt
from parallelx.check.runs import RunResult

#: The least tolerance, by the loop's precision: 16 float32 roundings; the autocast type's rounding.
MIN_TOLERANCE = {"32": 16 * 2.0**-24, "bf16-mixed": 2.0**-8, "16-mixed": 2.0**-10, "bf16-compute": 2.0**-8}
#: Each tensor's tolerance: this many times its measured floor.
FACTOR = 10.0
FLOOR_METHOD = "the reference again with each initial weight moved by half a float32 rounding (random signs)"
BUFFER_HINT = ("running_mean", "running_var", "num_batches_tracked")


# ---------------------------------------------------------------- numbers
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The relative L2 difference of two tensors (0 when equal; symmetric)."""
    if a.shape != b.shape:
        return math.inf
    if not (a.is_floating_point() and b.is_floating_point()):
        return 0.0 if torch.equal(a, b) else 1.0
    a64, b64 = a.double(), b.double()
    d = float(torch.linalg.vector_norm(a64 - b64))
    if d == 0:
        return 0.0
    scale = max(float(torch.linalg.vector_norm(a64)), float(torch.linalg.vector_norm(b64)))
    return d / scale if scale > 0 else math.inf


def per_tensor(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """:func:`rel` of each tensor of ``a`` and ``b`` (inf for a tensor only one of them has)."""
    return {k: (rel(a[k], b[k]) if k in a and k in b else math.inf) for k in sorted({*a, *b})}


def compare(
    a: Mapping[str, torch.Tensor] | None,
    b: Mapping[str, torch.Tensor] | None,
    floors: Mapping[str, float] | None,
    min_tol: float,
    factor: float = FACTOR,
) -> Diff | None:
    """``a`` against ``b``, each tensor judged against ``factor`` x its floor (at least ``min_tol``)."""
    if a is None or b is None:
        return None
    diffs = per_tensor(a, b)
    if not diffs:
        return None

    def tol(k: str) -> float:
        return max(min_tol, factor * (floors or {}).get(k, 0.0))

    # Counters (num_batches_tracked) differ or not: the largest is shown among the floating tensors.
    floating = [k for k in diffs if k in a and k in b and a[k].is_floating_point()] or list(diffs)
    worst = max(floating, key=lambda k: diffs[k])
    floor = None if floors is None else floors.get(worst, 0.0)
    return Diff(
        worst=diffs[worst],
        tensor=worst,
        floor=floor,
        tolerance=tol(worst),
        out=[k for k, v in diffs.items() if v > tol(k)],
        floor_max=None if not floors else max(floors.values()),
    )


def mean(xs: Iterable[float]) -> float | None:
    values = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(values) / len(values) if values else None


def series(run: RunResult, steps: int) -> dict[str, list[float | None]]:
    """The loss (the mean over every rank's micro-batches) and the gradient norm at each step."""
    losses = [mean(run.losses(s)) for s in range(1, steps + 1)]
    norms = []
    for s in range(1, steps + 1):
        entry = run.step(0, s)
        norms.append(None if entry is None else entry.get("grad_norm"))
    return {"loss": losses, "gradient norm": norms}


def weights_by_step(run: RunResult, steps: int) -> list[dict[str, str]] | None:
    """The digests of rank 0's weights after each of the ``steps`` steps (None: a step not recorded)."""
    out = []
    for s in range(1, steps + 1):
        entry = run.step(0, s)
        if entry is None or not entry.get("weights"):
            return None
        out.append(entry["weights"])
    return out


def without_gradients(values: dict[str, list[float | None]]) -> dict[str, list[float | None]]:
    """A run's series with its gradient norms left out (the loss alone is compared)."""
    return {k: ([None] * len(v) if k == "gradient norm" else v) for k, v in values.items()}


def rel_scalar(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else math.inf


def floor_series(reference: RunResult, floor: RunResult, steps: int) -> dict[str, list[float]]:
    """The floor of each series at each step: the largest so far (noise only grows)."""
    a, b = series(reference, steps), series(floor, steps)
    out: dict[str, list[float]] = {}
    for key in a:
        running = 0.0
        values = []
        for x, y in zip(a[key], b[key]):
            r = rel_scalar(x, y)
            if r is not None and math.isfinite(r):
                running = max(running, r)
            values.append(running)
        out[key] = values
    return out


def first_out(
    run: dict[str, list[float | None]],
    other: dict[str, list[float | None]],
    floors: dict[str, list[float]] | None,
    min_tol: float,
    factor: float = FACTOR,
) -> tuple[int, str, float, float] | None:
    """The first step (1-based) whose loss or gradient norm leaves the tolerance: (step, which, difference, tolerance)."""
    steps = min(len(run["loss"]), len(other["loss"]))
    for i in range(steps):
        for key in ("loss", "gradient norm"):
            r = rel_scalar(run[key][i], other[key][i])
            if r is None:
                continue
            tol = max(min_tol, factor * (floors[key][i] if floors else 0.0))
            if r > tol:
                return i + 1, key, r, tol
    return None


def noise_only(reference: Mapping[str, torch.Tensor], floor: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Tensors with gradients that are rounding noise: zero in exact arithmetic
    (a softmax's shift, GPT-2's attention key bias), so that any other order
    of the same additions gives another sign and size.  {name: (noisy, numel)}."""
    out = {}
    for k, r in reference.items():
        f = floor.get(k)
        if f is None or f.shape != r.shape or not r.is_floating_point():
            continue
        r64, f64 = r.double().reshape(-1), f.double().reshape(-1)
        big = torch.maximum(r64.abs(), f64.abs())
        noisy = int(((r64 - f64).abs() > 0.5 * big).logical_and(big > 0).sum())
        if noisy and noisy >= max(1, r64.numel() // 100):
            out[k] = (noisy, r64.numel())
    return out


def name(run: RunResult) -> str:
    """A run as the report's sentences name it."""
    return "the one-process reference" if not run.spec.real else run.label


def drawn(micro: Iterable[dict[str, Any]]) -> set[str]:
    """The generators these forwards drew from (dropout: torch's)."""
    return {g for m in micro for g in (m.get("draws") or [])}


def states(m: dict[str, Any], generators: Iterable[str]) -> tuple[str | None, ...]:
    """The states of ``generators`` at forward ``m``."""
    return tuple(m["rng"].get(g) for g in sorted(generators))


def same_computation(reference: RunResult, floor: RunResult) -> str | None:
    """None when the floor run computed what the reference did (its weights
    aside): the same initial weights, inputs and random state at each
    forward of the first step; else what differed."""
    a, b = reference.rank0().get("models", []), floor.rank0().get("models", [])
    if [m.get("initial") for m in a] != [m.get("initial") for m in b]:
        return "started from different initial weights"
    for r in range(reference.n_ranks()):
        ma, mb = reference.micro(r, 1), floor.micro(r, 1)
        if [m["input"] for m in ma] != [m["input"] for m in mb]:
            return "read different inputs"
        gens = drawn(ma + mb)
        if [states(m, gens) for m in ma] != [states(m, gens) for m in mb]:
            return "drew different random numbers"
    return None


# ---------------------------------------------------------------- the analysis
class Analysis:
    """Reads the runs of one check and writes its :class:`Report`."""

    def __init__(
        self,
        script: Sequence[str],
        reference: RunResult | None,
        floor: RunResult | None,
        runs: Sequence[RunResult],
        *,
        nproc: int,
        steps: int,
        rtol: float | None = None,
        seconds: float = 0.0,
        factor: float = FACTOR,
        tensor_parallel: int = 1,
    ) -> None:
        self.script = list(script)
        self.reference = reference if reference is not None and reference.usable else None
        self.reference_raw = reference
        self.floor_raw = floor
        self.floor = floor if floor is not None and floor.usable else None
        #: Why the floor run cannot measure the noise (None: it can).
        self.floor_problem: str | None = None
        if self.reference is not None and self.floor is not None:
            self.floor_problem = same_computation(self.reference, self.floor)
            if self.floor_problem is not None:
                self.floor = None
        self.runs = list(runs)
        self.usable = [r for r in self.runs if r.usable]
        #: The data-parallel ranks (the processes, or under tensor parallelism their groups).
        self.nproc = nproc
        self.tensor_parallel = tensor_parallel
        self.steps = steps
        self.rtol = rtol
        self.seconds = seconds
        self.factor = factor
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.limits: list[str] = []
        self.base = self.usable[0] if self.usable else None

    # ------------------------------------------------------------ helpers
    def add(self, cause: str, what: str, fix: str, runs: Iterable[str], fails: bool = True) -> None:
        runs = list(runs)
        for f in self.findings:
            if f.cause == cause and f.what == what:
                f.runs += [r for r in runs if r not in f.runs]
                return
        self.findings.append(Finding(cause, what, fix, runs, fails))

    def blamed(self, label: str) -> bool:
        return any(label in f.runs and f.fails for f in self.findings)

    def precision(self) -> str:
        src = self.base or self.reference
        return str(src.options().get("precision", "32")) if src is not None else "32"

    def min_tol(self) -> float:
        if self.rtol is not None:
            return self.rtol
        return MIN_TOLERANCE.get(self.precision(), MIN_TOLERANCE["32"])

    @staticmethod
    def initial(run: RunResult) -> dict[str, str]:
        models = run.rank0().get("models", [])
        return dict(models[0]["initial"]) if models else {}

    @staticmethod
    def buffers(run: RunResult) -> set[str]:
        models = run.rank0().get("models", [])
        out: set[str] = set()
        for i, m in enumerate(models):
            out |= {f"{i}.{k}" if i else k for k in m.get("buffers", [])}
        return out

    def is_buffer(self, run: RunResult, name: str) -> bool:
        return name in self.buffers(run) or name.endswith(BUFFER_HINT)

    @staticmethod
    def has_batchnorm(run: RunResult, per_rank: bool | None = None) -> bool:
        for m in run.rank0().get("models", []):
            if m.get("batchnorm") and (per_rank is None or bool(m.get("batchnorm_per_rank")) == per_rank):
                return True
        return False

    # ------------------------------------------------------------ the rules
    def ranks(self, run: RunResult) -> tuple[bool | None, int | None]:
        """Do the ranks of ``run`` hold the same weights after every step?  If not, why."""
        if run.n_ranks() < 2:
            return None, None
        counts = run.steps_done()
        if len(set(counts.values())) > 1:
            most = max(counts.values())
            behind = {r: n for r, n in counts.items() if n < most}
            told = ", ".join(f"rank {r} took {n}" for r, n in sorted(behind.items()))
            self.add(
                "step-on-some-ranks",
                f"the ranks took different numbers of optimizer steps on {run.label}: {told}, the others {most}: "
                "a step taken on some ranks only",
                "call optimizer.step() (or backend.step) on every rank, not under `if backend.is_main()` or "
                "another rank-dependent condition",
                [run.label],
            )
            return False, min(counts.values()) + 1
        n = min(counts.values()) if counts else 0
        ranks = sorted(run.ranks)
        for s in range(1, n + 1):
            entries = {r: run.step(r, s) for r in ranks}
            if any(e is None for e in entries.values()):
                continue
            weights = {r: e["weights"] for r, e in entries.items() if e is not None}
            if all(w == weights[ranks[0]] for w in weights.values()):
                continue
            names = sorted(k for k in weights[ranks[0]] if len({str(w.get(k)) for w in weights.values()}) > 1)
            self._ranks_cause(run, s, entries, names)
            return False, s
        return True, None

    def _ranks_cause(self, run: RunResult, s: int, entries: dict[int, Any], names: list[str]) -> None:
        groups = {r: e.get("groups") for r, e in entries.items()}
        r0 = min(groups)
        for r, g in groups.items():
            if g is None or groups[r0] is None or g == groups[r0]:
                continue
            detail = _group_difference(groups[r0], g, r0, r)
            self.add(
                "rank-dependent-hyperparameters",
                f"the ranks hold different weights after step {s} on {run.label}: {detail}: a hyperparameter that "
                "depends on the rank",
                "compute every hyperparameter the same way on every rank (no backend.rank or is_main() in it)",
                [run.label],
            )
            return
        grads = {r: e.get("grads") for r, e in entries.items()}
        if len({str(g) for g in grads.values()}) > 1:
            self.add(
                "rank-dependent-gradients",
                f"the averaged gradients differ between the ranks at step {s} on {run.label}: code between the "
                "backward and the step changes them on some ranks only",
                "leave the gradients alone between backend.backward and the step, or change them the same way "
                "on every rank",
                [run.label],
            )
            return
        shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        if names and all(self.is_buffer(run, k) for k in names):
            bn = " (BatchNorm statistics)" if self.has_batchnorm(run) else ""
            self.add(
                "rank-dependent-buffers",
                f"the ranks hold different buffers{bn} after step {s} on {run.label} ({shown}): each rank keeps "
                "statistics of its own batches that reach no other rank",
                "call backend.sync_batchnorm(model) before wrap_model, and run every forward that updates buffers "
                "on the wrapped model, before the step",
                [run.label],
            )
            return
        self.add(
            "rank-dependent-update",
            f"the ranks hold different weights after step {s} on {run.label} ({shown}) although their gradients "
            "and hyperparameters agree: rank-dependent code changes the weights",
            "look for code that uses backend.rank or is_main() between the backward and the next forward "
            "(a step, a weight change, a reload on some ranks only)",
            [run.label],
        )

    def same_samples(self, run: RunResult) -> None:
        """Every rank read the very same inputs: a loader that does not shard."""
        if run.n_ranks() < 2 or len(run.ranks) < 2:
            return
        per_rank = {r: [m["input"] for m in run.micro(r, 1)] for r in sorted(run.ranks)}
        lengths = [len(v) for v in per_rank.values()]
        if min(lengths) == 0:
            return
        k = min(lengths)
        if len({tuple(v[:k]) for v in per_rank.values()}) == 1:
            self.add(
                "unsharded-loader",
                f"every rank read the same samples at step 1 ({run.label}): the loader does not shard the data, "
                "so each step averages N copies of one batch",
                "build the loader on the backend's sampler: DataLoader(dataset, sampler=backend.make_sampler(dataset), "
                "batch_size=...) (not shuffle=True, and pass the sampler you made)",
                [run.label],
            )

    def between_runs(self, runs: Sequence[RunResult]) -> None:
        """Initial weights, first inputs, first forward: what must not differ between runs."""
        base = runs[0]
        for run in runs[1:]:
            a, b = self.initial(base), self.initial(run)
            if a and b and a != b:
                names = sorted(k for k in {*a, *b} if a.get(k) != b.get(k))
                buffers = self.buffers(base)
                weights = [k for k in names if k not in buffers]
                kind = "initial weights" if weights else "initial buffers"
                shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
                self.add(
                    "initial-weights",
                    f"the {kind} differ between runs ({shown}; rank 0's, before wrapping): the difference is there "
                    "at the very first forward",
                    "seed before building the model, the same seed in every run: parallelx.seed_everything(seed) "
                    "(no time, process id or backend in the seed)",
                    [base.label, run.label],
                )
                continue
            first_a, first_b = base.micro(0, 1), run.micro(0, 1)
            if not first_a or not first_b:
                continue
            if first_a[0]["input"] != first_b[0]["input"]:
                self.add(
                    "data-randomness",
                    f"the data differs between runs from the first batch (rank 0's inputs on {name(base)} and "
                    f"{name(run)}): shuffling or augmentation draws random numbers that are not seeded the same way "
                    "in every run",
                    "seed every generator the data uses, the same in every run (parallelx.seed_everything(seed)), and "
                    "shuffle with backend.make_sampler(dataset, seed=...)",
                    [base.label, run.label],
                )
                continue
            la, lb = base.losses(1), run.losses(1)
            if la and lb and rel_scalar(la[0], lb[0]) not in (0.0, None):
                gens = drawn(first_a + first_b)
                if gens:
                    state = (
                        "the generators' state at the first forward differs"
                        if states(first_a[0], gens) != states(first_b[0], gens)
                        else "the forward draws differently"
                    )
                    self.add(
                        "forward-randomness",
                        f"the first forward gives another loss on {name(run)} than on {name(base)} with the same "
                        f"weights and inputs, and it draws random numbers (dropout): {state}; the backends do not "
                        "share these draws",
                        "seed once at the start, the same in every run (parallelx.seed_everything(seed)), draw "
                        "nothing from the time, the process id or the backend, and under --compile keep eager's draws "
                        "(the default; --compile-random inductor draws other dropout masks)",
                        [base.label, run.label],
                    )

    def options(self, runs: Sequence[RunResult]) -> None:
        """A backend whose loop options (its config) change the math."""
        if len(runs) < 2:
            return
        base = runs[0]
        mine = base.options()
        for run in runs[1:]:
            theirs = run.options()
            changed = [k for k in sorted({*mine, *theirs}) if mine.get(k) != theirs.get(k)]
            if not changed:
                continue
            told = ", ".join(f"{k}={theirs.get(k)!r} (on {name(base)}: {mine.get(k)!r})" for k in changed)
            said = [w for w in run.warnings if "differs" in w or "config" in w]
            why = f"; it says: {said[0]}" if said else ""
            self.add(
                "backend-option",
                f"{run.label} runs with {told}{why}: a backend option changes the math",
                "give every backend the same loop options (--accumulate, --clip-grad-norm, --precision); remove "
                "them from a backend's own config (a DeepSpeed config's gradient_clipping, for one)",
                [run.label],
            )

    def hyperparameters(self, runs: Sequence[RunResult]) -> None:
        base = runs[0]
        for run in runs[1:]:
            for s in range(1, self.steps + 1):
                a, b = base.step(0, s), run.step(0, s)
                if a is None or b is None or a.get("groups") is None or b.get("groups") is None:
                    continue
                if not _groups_close(a["groups"], b["groups"]):
                    detail = _group_difference(a["groups"], b["groups"], base.label, run.label)
                    self.add(
                        "backend-hyperparameters",
                        f"the optimizer's hyperparameters differ between runs at step {s}: {detail}",
                        "set hyperparameters from the script's arguments alone (not from backend.name, and the same "
                        "world-size scaling on every backend)",
                        [run.label],
                    )
                    break

    # ------------------------------------------------------------ level 2: what the reference can stand for
    def repeats(self) -> bool:
        """True when the floor run repeated the reference's computation (weights aside): the
        script is deterministic, so whatever else differs from the reference is the replay's."""
        return self.floor is not None and self.floor_problem is None

    def reference_limits(self) -> None:
        raw = self.reference_raw
        if self.reference is None:
            why = raw.error if raw is not None and raw.error else "it did not run"
            self.limits.append(f"the one-process reference failed ({why})")
            return
        self.limits += list(self.reference.rank0().get("reference", {}).get("limits", []))
        base = self.base
        if base is None:
            return
        if self.has_batchnorm(base, per_rank=False) and base.n_ranks() > 1:
            self.limits.append(
                "the model's BatchNorm is synchronised over the ranks (sync_batchnorm): one process playing the "
                "ranks one after another normalises each rank's micro-batch alone"
            )
        firsts = [base.micro(r, 1) for r in sorted(base.ranks)]
        gens = drawn(m for f in firsts for m in f)
        if all(firsts) and gens and len({states(f[0], gens) for f in firsts}) > 1:
            self.limits.append(
                "the ranks draw different random numbers (a seed that depends on the rank) in the forward: one "
                "process cannot replay them"
            )
        if self.limits:
            return
        if self.initial(self.reference) != self.initial(base):
            self.limits.append("the reference built other initial weights than rank 0 did")
            return
        mine, theirs = self.reference.micro(0, 1), base.micro(0, 1)
        gens = drawn(mine[:1] + theirs[:1])
        if mine and theirs and gens and states(mine[0], gens) != states(theirs[0], gens):
            self.limits.append("the reference's random state at the first forward differs from rank 0's")
            return
        steps = min(self.reference.steps_done().get(0, 0), min(base.steps_done().values(), default=0))
        for s in range(1, steps + 1):
            for r in sorted(base.ranks):
                mine = [m["input"] for m in self.reference.micro(r, s)]
                theirs = [m["input"] for m in base.micro(r, s)]
                if mine != theirs:
                    self.limits.append(
                        f"the reference could not rebuild rank {r}'s inputs at step {s} (data drawn per rank outside "
                        "backend.make_sampler, or augmentation in DataLoader workers)"
                    )
                    return
            a, b = self.reference.step(0, s), base.step(0, s)
            if a and b and a.get("groups") and b.get("groups") and not _groups_close(a["groups"], b["groups"]):
                detail = _group_difference(a["groups"], b["groups"], "the reference", base.label)
                self.limits.append(
                    f"the hyperparameters at step {s} differ ({detail}): the script sets them from its own count of "
                    f"iterations, which one process playing {self.nproc} ranks advances {self.nproc} times per step"
                )
                return

    # ------------------------------------------------------------ putting it together
    def report(self) -> Report:
        min_tol = self.min_tol()
        steps = self.steps
        for run in self.usable:
            self.same_samples(run)
        # Options: the one-process reference ran with the same arguments (a backend's config aside).
        self.options([r for r in [self.reference, *self.usable] if r is not None])
        if len(self.usable) > 1:
            self.between_runs(self.usable)
            self.hyperparameters(self.usable)
        if self.reference is not None and self.usable and not self.repeats():
            # The script does not repeat itself: what differs from the reference is the script's doing.
            self.between_runs([self.usable[0], self.reference])
        self.reference_limits()
        level = 1 if self.limits else 2

        floor_w = floor_g = None
        floors_s = None
        if self.reference is not None and self.floor is not None:
            if self.reference.weights is not None and self.floor.weights is not None:
                floor_w = per_tensor(self.reference.weights, self.floor.weights)
            if self.reference.grads is not None and self.floor.grads is not None:
                floor_g = per_tensor(self.reference.grads, self.floor.grads)
                for name, (k, n) in noise_only(self.reference.grads, self.floor.grads).items():
                    self.notes.append(
                        f"{name}: {k} of its {n} gradients are rounding noise alone (zero in exact arithmetic, as "
                        "an attention key bias's; an adaptive optimizer such as Adam turns that noise into steps): "
                        "judged against its own floor"
                    )
            floors_s = floor_series(self.reference, self.floor, steps)
            floor_method = FLOOR_METHOD
        elif self.floor_problem is not None:
            floor_method = f"the reference and its repeat {self.floor_problem}: the script does not repeat itself"
        else:
            why = next((r.error for r in (self.reference_raw, self.floor_raw) if r is not None and r.error), None)
            floor_method = "the reference or its floor run failed" + (f" ({why})" if why else "")

        ref_series = series(self.reference, steps) if self.reference is not None else None
        base_series = series(self.base, steps) if self.base is not None else None
        rows = []
        for run in self.runs:
            rows.append(self._row(run, level, min_tol, floor_w, floor_g, floors_s, ref_series, base_series))
        self._buffers_per_rank(rows)
        self._unexplained(rows, level)
        self._batchnorm_notes()
        for row, run in zip(rows, self.runs):
            if run.launch_error is None or row.status == "failed":
                continue
            if self.blamed(run.label):
                self.notes.append(
                    f"{run.label}: every rank recorded its steps, then the launch failed ({run.launch_error}): "
                    "a consequence of the difference above"
                )
            else:
                row.status, row.error = "failed", run.launch_error

        ref_row = None
        if self.reference_raw is not None:
            raw = self.reference_raw
            ref_row = Row(
                "reference",
                raw.seconds,
                steps=max(raw.steps_done().values(), default=0),
                status="same" if raw.usable else "failed",
                error=raw.error,
            )
        failed = [r for r in rows if r.status == "failed"]
        differing = [f for f in self.findings if f.fails]
        stepless = bool(self.usable) and all(max(r.steps_done().values(), default=0) == 0 for r in self.usable)
        if stepless and failed and not differing:
            # A run that raised before its first step: its error says why, not a missing wrap_optimizer.
            code = COULD_NOT_RUN
            verdict = f"exit 2: the check could not run {', '.join(r.label for r in failed)}: {failed[0].error}"
        elif stepless and not differing:
            code = COULD_NOT_RUN
            verdict = (
                "exit 2: no run took an optimizer step that parallelx saw: wrap the optimizer "
                "(optimizer = backend.wrap_optimizer(optimizer), or backend.setup(model, optimizer)) and let the "
                "script train for at least one step"
            )
        elif differing:
            code = DIFFERS
            verdict = (
                f"exit 1: {len(differing)} difference{'s' if len(differing) > 1 else ''} found "
                f"({', '.join(sorted({f.cause for f in differing}))})"
            )
        elif failed or not self.usable:
            code = COULD_NOT_RUN
            names = ", ".join(r.label for r in failed) or "every run"
            verdict = f"exit 2: the check could not run {names}: {failed[0].error if failed else 'no run'}"
        else:
            code = SAME
            against = "one process computing the global batch and each other" if level == 2 else "each other"
            verdict = (
                f"exit 0: the same numbers on every backend: each agrees with {against}, within the measured tolerance"
            )
        return Report(
            script=self.script,
            nproc=self.nproc,
            tensor_parallel=self.tensor_parallel,
            steps=steps,
            level=level,
            level_reason="; ".join(self.limits) if self.limits else None,
            floor_method=floor_method,
            floor_grads=max(floor_g.values()) if floor_g else None,
            floor_weights=max(floor_w.values()) if floor_w else None,
            min_tolerance=min_tol,
            factor=self.factor,
            baseline=self.base.label if self.base is not None else None,
            reference=ref_row,
            rows=rows,
            findings=self.findings,
            notes=self.notes,
            exit_code=code,
            verdict=verdict,
            seconds=self.seconds,
        )

    def _row(
        self,
        run: RunResult,
        level: int,
        min_tol: float,
        floor_w: dict[str, float] | None,
        floor_g: dict[str, float] | None,
        floors_s: dict[str, list[float]] | None,
        ref_series: dict[str, list[float | None]] | None,
        base_series: dict[str, list[float | None]] | None,
    ) -> Row:
        row = Row(run.label, run.seconds, steps=max(run.steps_done().values(), default=0))
        if not run.usable:
            row.status, row.error = "failed", run.error
            return row
        row.ranks_agree, row.ranks_differ_at = self.ranks(run)
        base = self.base
        assert base is not None
        if self.reference is not None:
            row.grads_vs_reference = compare(run.grads, self.reference.grads, floor_g, min_tol, self.factor)
            row.weights_vs_reference = compare(run.weights, self.reference.weights, floor_w, min_tol, self.factor)
        if run is not base:
            row.grads_vs_baseline = compare(run.grads, base.grads, floor_g, min_tol, self.factor)
            row.weights_vs_baseline = compare(run.weights, base.weights, floor_w, min_tol, self.factor)
        # Weights equal to the bit after every step: every update was the same, so gradients that
        # "differ" were read where they were not final yet (before the backend's own averaging), which
        # is the check's fault and never a verdict on the script.
        exact_ref = self.reference is not None and self._same_weights(run, self.reference, row.weights_vs_reference)
        exact_base = run is not base and self._same_weights(run, base, row.weights_vs_baseline)
        mine = series(run, self.steps)
        other = ref_series if level == 2 else (base_series if run is not base else None)
        if other is not None:
            exact = exact_ref if level == 2 else exact_base
            out = first_out(without_gradients(mine) if exact else mine, other, floors_s, min_tol, self.factor)
            if out is not None:
                row.first_step_out, row.first_step_what = out[0], out[1]
            if exact and first_out(mine, other, floors_s, min_tol, self.factor) not in (None, out):
                self._misread(run, "the gradient norm", "the reference" if level == 2 else base.label)
        grads_base = None if exact_base else row.grads_vs_baseline
        grads_ref = None if exact_ref else row.grads_vs_reference
        for d, exact, against in (
            (row.grads_vs_baseline, exact_base, base.label),
            (row.grads_vs_reference, exact_ref and level == 2, "the reference"),
        ):
            if exact and d is not None and not d.ok:
                self._misread(run, f"the step-1 gradients ({fmt(d.worst)} at {d.tensor})", against)
        bad = row.ranks_agree is False or row.first_step_out is not None
        bad |= any(d is not None and not d.ok for d in (grads_base, row.weights_vs_baseline))
        if level == 2:
            bad |= any(d is not None and not d.ok for d in (grads_ref, row.weights_vs_reference))
        row.status = "differs" if bad else "same"
        if not bad:
            d = row.weights_vs_baseline or (row.weights_vs_reference if level == 2 else None)
            if d is not None and d.worst > 0:
                against = "the reference" if d is row.weights_vs_reference else base.label
                self.notes.append(
                    f"{run.label}: within the floor of {against} (weights {fmt(d.worst)} at {d.tensor}, its floor "
                    f"{fmt(d.floor)}): the same additions in another order"
                )
        return row

    def _same_weights(self, run: RunResult, other: RunResult, final: Diff | None) -> bool:
        """``run``'s weights are ``other``'s to the bit after every step (the last one's whole tensors too)."""
        mine = weights_by_step(run, self.steps)
        return mine is not None and mine == weights_by_step(other, self.steps) and (final is None or final.worst == 0)

    def _misread(self, run: RunResult, what: str, against: str) -> None:
        note = (
            f"{run.label}: {what} the check read differ from {against}'s, while the weights are {against}'s to the "
            "bit after every step: the check read those gradients before they were final (a fault of the check, "
            "not of the script; please report it to parallelx)"
        )
        if note not in self.notes:
            self.notes.append(note)

    def rank_buffers(self, run: RunResult) -> tuple[int, list[str]] | None:
        """The first step whose first forward found the ranks' buffers different, and which."""
        for s in range(1, self.steps + 1):
            firsts = [m[0] for r in range(run.n_ranks()) if (m := run.micro(r, s)) and "buffers" in m[0]]
            if len(firsts) < 2:
                continue
            names = sorted(k for k in firsts[0]["buffers"] if len({str(f["buffers"].get(k)) for f in firsts}) > 1)
            if names:
                return s, names
        return None

    def _buffers_per_rank(self, rows: list[Row]) -> None:
        """Ranks that start a step with different buffers: what they normalise with differs."""
        runs = [r for r in [*self.usable, self.reference] if r is not None]
        evidence = {run.label: e for run in runs if (e := self.rank_buffers(run)) is not None}
        if not evidence:
            return
        label, (s, names) = next(iter(evidence.items()))
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        run = next(r for r in runs if r.label == label)
        bn = self.has_batchnorm(run)
        what = "BatchNorm statistics" if bn else "buffers"
        differs = [r.label for r in rows if r.status == "differs"]
        self.add(
            "batchnorm-statistics" if bn else "rank-dependent-buffers",
            f"the ranks start step {s} with different {what} ({shown}; on {', '.join(evidence)}): each rank computed "
            "its own, from its own batches, outside the training step; ddp broadcasts rank 0's before every "
            "forward, the other backends after each step, so the backends normalise differently",
            "compute them the same on every rank: backend.sync_batchnorm(model) before wrap_model, and no "
            "training-mode forward outside the training steps (or recompute them after the first step)",
            differs or list(evidence),
            fails=bool(differs),
        )

    def _unexplained(self, rows: list[Row], level: int) -> None:
        """Differences no rule explained: say where they are and what to look for."""
        base = self.base
        for row in rows:
            if row.status != "differs" or self.blamed(row.label):
                continue
            explained_elsewhere = [f for f in self.findings if f.fails and base is not None and base.label in f.runs]
            if explained_elsewhere and row.label != (base.label if base else None):
                # A difference of the baseline (its options, its ranks) shows in every comparison with it.
                continue
            d_base = row.weights_vs_baseline
            d_ref = row.weights_vs_reference
            where = ""
            d = d_base if d_base is not None and not d_base.ok else d_ref
            if d is not None and d.tensor:
                where = f"; largest at {d.tensor} ({fmt(d.worst)}, tolerance {fmt(d.tolerance)})"
            step = f" from step {row.first_step_out} ({row.first_step_what})" if row.first_step_out else ""
            others_agree = d_base is None or d_base.ok
            if level == 2 and others_agree:
                bn = self.has_batchnorm(base) if base is not None else False
                out_tensors = d_ref.out if d_ref is not None else []
                run = next(r for r in self.runs if r.label == row.label)
                if bn and out_tensors and all(self.is_buffer(run, k) for k in out_tensors):
                    self.add(
                        "batchnorm-statistics",
                        f"{row.label}: only the BatchNorm statistics differ from one process{where}: each rank "
                        "updates them from its own batches",
                        "backend.sync_batchnorm(model) before wrap_model, and keep every training-mode forward inside "
                        "the training step",
                        [row.label],
                    )
                    continue
                self.add(
                    "differs-from-one-process",
                    f"{row.label} differs from one process computing the same global batch{step}{where}, while the "
                    "backends agree with each other: the script's arithmetic depends on how the batch is split",
                    "look for collectives (all_reduce, broadcast) or rank-dependent code in the forward and the loss, "
                    "and make each rank's loss the mean over its own samples",
                    [row.label],
                )
            else:
                self.add(
                    "backends-differ",
                    f"{row.label} differs from {base.label if base else 'the first run'}{step}{where}",
                    "compare the backends' warnings and options above; with none, send this report to parallelx",
                    [row.label],
                )

    def _batchnorm_notes(self) -> None:
        base = self.base
        if base is not None and base.n_ranks() > 1 and self.has_batchnorm(base, per_rank=True):
            self.add(
                "batchnorm-per-rank",
                "BatchNorm normalises with each rank's own micro-batch (inherent, not a failure): the reference does "
                "the same, but one process on the whole global batch in one forward would differ",
                "backend.sync_batchnorm(model) before wrap_model normalises over the global batch",
                [base.label],
                fails=False,
            )


def _groups_close(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    if len(a) != len(b):
        return False
    for ga, gb in zip(a, b):
        for k in set(ga) & set(gb):
            va, vb = ga[k], gb[k]
            xs = va if isinstance(va, list) else [va]
            ys = vb if isinstance(vb, list) else [vb]
            if len(xs) != len(ys) or any(not math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12) for x, y in zip(xs, ys)):
                return False
    return True


def _group_difference(a: list[dict[str, Any]], b: list[dict[str, Any]], who_a: Any, who_b: Any) -> str:
    na = who_a if isinstance(who_a, str) else f"rank {who_a}"
    nb = who_b if isinstance(who_b, str) else f"rank {who_b}"
    if len(a) != len(b):
        return f"{len(a)} parameter groups on {na}, {len(b)} on {nb}"
    for i, (ga, gb) in enumerate(zip(a, b)):
        for k in sorted(set(ga) & set(gb)):
            if not _groups_close([{k: ga[k]}], [{k: gb[k]}]):
                return (
                    f"group {i}'s {k} is {ga[k]:g} on {na} and {gb[k]:g} on {nb}"
                    if not isinstance(ga[k], list)
                    else f"group {i}'s {k} is {ga[k]} on {na} and {gb[k]} on {nb}"
                )
    return "their groups differ"
