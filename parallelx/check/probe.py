"""What ``python -m parallelx check`` records inside each process of a run it launches.

The check (:mod:`parallelx.check`) starts the user's unmodified script with
``$PARALLELX_CHECK_DIR`` set and ``$PARALLELX_OBSERVERS`` naming :func:`attach`, which
:meth:`Backend.init` calls (a normal run names nothing and pays nothing).  The
:class:`Probe` is one of the facade's :class:`~parallelx.backend.Observer` objects:
it watches the run, never replaces a part of it, through the loop's watchers and
boundary hooks and the facade's observer calls (the model before and after
wrapping, the optimizer after wrapping, each sampler made, the shutdown):

- every training forward of a wrapped model: a digest of its inputs and of
  the random generators' state, and whether the forward drew random numbers;
- every loss passed to ``backend.backward`` (or to ``loss.backward()``);
- at every optimizer step: the averaged gradients (their global norm, each
  tensor's norm and digest; the whole tensors at the first step), the
  optimizer's hyperparameters, and a digest of every weight afterwards.  The
  gradients are read where the backend's reduction is over, whatever the
  loop's form: at ``backend.step``'s boundary (before clipping), else in the
  optimizer's step pre-hook, which every backend runs once its gradients are
  the averaged ones (never after a backward: DeepSpeed and Horovod average in
  ``optimizer.step()``);
- the weights before wrapping (the initial weights, before any broadcast),
  the loop options, the samplers made, the BatchNorm layers;

and after ``$PARALLELX_CHECK_STEPS`` optimizer steps it writes what it saw
(``rank<r>.json``; rank 0 also ``grads.pt`` and ``weights.pt``), waits for the
other ranks to do the same, and ends the process with exit status 0: every
rank at the same point, nothing left waiting in a collective.

In the check's one-process reference (``$PARALLELX_CHECK_RANKS`` = N) the
probe also builds the virtual world of :mod:`parallelx.check.world`, in which
one process computes what N ranks compute together.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import math
import os
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch
from torch import nn

from parallelx.backend import Backend, Observer
from parallelx.check import world as virtualworld
from parallelx.parts.loop import LoopOptions, LoopWatcher
from parallelx.parts.sampler import ShardedSampler
from parallelx.settings import limit_cpu_threads
from parallelx.transforms.buffers import per_process_batchnorm
from parallelx.utils import has_batchnorm

T = TypeVar("T")

#: The folder this run's records go to; set by the check, absent otherwise.
ENV_DIR = "PARALLELX_CHECK_DIR"
#: Optimizer steps after which the run stops.
ENV_STEPS = "PARALLELX_CHECK_STEPS"
#: The one-process reference: the number of ranks it plays.
ENV_RANKS = "PARALLELX_CHECK_RANKS"
#: The noise-floor run: the initial weights multiplied by 1 + this x (random signs).
ENV_PERTURB = "PARALLELX_CHECK_PERTURB"
#: Seconds a rank that has finished waits for the others before it exits anyway.
ENV_WAIT = "PARALLELX_CHECK_WAIT"

#: The optimizer hyperparameters recorded at each step (those present in a group).
HYPERPARAMETERS = ("lr", "weight_decay", "momentum", "betas", "eps", "dampening", "alpha", "rho", "lr_decay")


def attach(backend: Backend) -> Probe | None:
    """The probe for this process when the check launched it, else None."""
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return None
    return Probe(
        backend,
        Path(folder),
        steps=int(os.environ.get(ENV_STEPS, "3")),
        ranks=int(os.environ.get(ENV_RANKS, "0")),
        perturb=float(os.environ.get(ENV_PERTURB, "0")),
        wait=float(os.environ.get(ENV_WAIT, "30")),
    )


# ------------------------------------------------------------------ digests
def digest_bytes(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """A digest of a tensor's dtype, shape and bytes (equal digests: equal bits)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return digest_bytes(str(t.dtype).encode(), str(tuple(t.shape)).encode(), raw.numpy().tobytes())


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's arguments, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            yield from tensors_in(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def rng_digests() -> dict[str, str]:
    """A digest of each random generator's state: torch's (CPU, and CUDA once
    initialised), NumPy's and Python's; a script may seed some of them only."""
    np_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    out = {
        "torch": digest_bytes(torch.get_rng_state().numpy().tobytes()),
        "numpy": digest_bytes(np.asarray(np_state[1]).tobytes(), str(np_state[2]).encode()),
        "python": digest_bytes(repr(random.getstate()).encode()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = digest_bytes(*(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()))
    return out


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's hyperparameters, as plain numbers."""
    out = []
    for group in optimizer.param_groups:
        row: dict[str, Any] = {}
        for key in HYPERPARAMETERS:
            value = group.get(key)
            if isinstance(value, torch.Tensor):
                value = value.tolist()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[key] = float(value)
            elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
                row[key] = [float(v) for v in value]
        out.append(row)
    return out


# ------------------------------------------------------------------ the probe
class Probe(Observer):
    """Records one process of a checked run (see the module's docstring)."""

    def __init__(
        self, backend: Backend, folder: Path, *, steps: int, ranks: int = 0, perturb: float = 0.0, wait: float = 30.0
    ) -> None:
        self.backend = backend
        self.folder = folder
        self.limit = max(1, steps)
        self.perturb = perturb
        self.wait = wait
        # Under tensor parallelism a group of processes is one rank of the data: recorded once, by its
        # tensor-parallel rank 0, as the data-parallel rank (what the reference's virtual ranks are).
        mesh = backend.mesh
        self.rank = mesh.data_rank
        self.records = mesh.tp_rank == 0
        self.process = backend.rank
        self.world = backend.comm.world_size  # the processes (in the reference: 1)
        self.models: list[nn.Module] = []  # as wrap_model returned them
        self.optimizers: list[torch.optim.Optimizer] = []
        self.averages: list[Any] = []  # the script's weight averages (parallelx.EMA)
        self.steps_done = 0  # optimizer steps of the first optimizer, completed
        self.record: dict[str, Any] = {
            "rank": self.rank,
            "processes": self.world,
            "backend": backend.name,
            "device": str(backend.device),
            "virtual_ranks": ranks,
            "perturb": perturb,
            "models": [],
            "samplers": [],
            "micro": [],
            "losses": [],
            "steps": [],
            "stopped": None,
        }
        self.capture: dict[str, Any] | None = None  # the gradients seen for the step under way
        self.captured_at_boundary = False
        self.first_grads: dict[str, torch.Tensor] | None = None
        self.inside_backward = False
        self.pending_forward: dict[str, Any] | None = None
        self.done = False
        self.started = time.monotonic()
        #: The reference's virtual world (None in a real run).
        self.world_of: virtualworld.VirtualWorld | None = None
        if ranks > 1:
            self.world_of = virtualworld.VirtualWorld(ranks, self.modules, self.loop_window)
            virtualworld.install()
            # A rank's share of the cores, as each of the N processes has: the same intra-op sums.
            limit_cpu_threads(backend.device, ranks)
        folder.mkdir(parents=True, exist_ok=True)
        #: True while ``backend.step`` runs.
        self.in_step = False
        loop = backend.loop
        assert loop is not None, "the facade attaches its observers once its loop is made"
        loop.add_watcher(ProbeWatcher(self))
        loop.add_boundary_hook(self.at_boundary)
        _patch_tensor_backward(self)
        atexit.register(self.finish, collective=False)

    # ----------------------------------------------------------- the calls of the protocol
    def modules(self) -> list[nn.Module]:
        """The user's modules inside the wrapped models."""
        return [self.backend.unwrap(m) for m in self.models]

    @property
    def virtual_ranks(self) -> int:
        return self.world_of.ranks if self.world_of is not None else 0

    def before_wrap(self, model: nn.Module) -> None:
        """The model as the script built it: its initial weights on this rank, before any broadcast."""
        state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        buffers = {n for n, _ in model.named_buffers()}
        self.record["models"].append(
            {
                "initial": {k: tensor_digest(v) for k, v in state.items()},
                "buffers": sorted(k for k in state if k in buffers),
                "batchnorm": has_batchnorm(model),
                "batchnorm_per_rank": per_process_batchnorm(model),
                "parameters": sum(p.numel() for p in model.parameters()),
            }
        )
        if self.perturb > 0:
            # The noise-floor run: every weight moved by `perturb` (half a float32 rounding), random signs,
            # from a generator of its own (the script's random numbers stay as they were).
            g = torch.Generator().manual_seed(1234 + len(self.record["models"]))
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        sign = torch.randint(0, 2, p.shape, generator=g).to(p.device, p.dtype) * 2 - 1
                        p.mul_(1 + self.perturb * sign)

    def wrapped_model(self, wrapped: nn.Module) -> None:
        self.models.append(wrapped)
        wrapped.register_forward_pre_hook(self._forward_pre, with_kwargs=True, prepend=True)
        wrapped.register_forward_hook(self._forward_post, with_kwargs=True)

    def wrapped_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        index = len(self.optimizers)
        self.optimizers.append(optimizer)
        depth = [0]

        # Every strategy's optimizer runs torch's step pre-hooks once its gradients are the
        # averaged ones the update uses (DeepSpeed's after its boundary's reduction, which runs
        # in step): the one place, whatever the loop's form, where they are final.  A wrapper
        # optimizer's step calls its base class's step and torch runs the hooks around both
        # (Horovod averages between the two): each pre-hook reads again, so the innermost one's
        # reading is kept; the outermost post-hook ends the step.
        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            depth[0] += 1
            if index == 0 and not self.captured_at_boundary:
                self._capture(optimizer)

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            depth[0] = max(0, depth[0] - 1)
            if depth[0] == 0 and index == 0:
                self._step_done(optimizer)

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)
        if self.world_of is not None:
            self.world_of.take_optimizer(optimizer)
        return optimizer

    def made_sampler(self, sampler: ShardedSampler, dataset: Sized) -> ShardedSampler:
        self.record["samplers"].append(
            {
                "size": sampler.dataset_size,
                "shuffle": sampler.shuffle,
                "seed": sampler.seed,
                "drop_last": sampler.drop_last,
                "shard": tensor_digest(
                    torch.tensor(sampler.global_order(sampler.epoch)[sampler.rank :: sampler.num_replicas])
                ),
            }
        )
        if self.world_of is not None:
            return self.world_of.sampler(sampler, dataset)
        return sampler

    def finish(self, collective: bool = True) -> None:
        """At the script's end (``shutdown``, every rank: ``collective``) or exit: write what was seen."""
        if self.done:
            return
        atexit.unregister(self.finish)
        weights = None
        if collective:
            with contextlib.suppress(Exception):
                weights = self._weights()
        self._write(f"the script ended after {self.steps_done} optimizer steps", weights)

    # ---------------------------------------------------------------- forward and backward
    def loop_window(self) -> tuple[bool, int, bool, bool]:
        """(the loop manages the current micro-batch, its position in the window, it is the
        window's last, the loop is stepping)."""
        loop = self.backend.loop
        assert loop is not None
        w = loop.window
        return w.managed, w.position, w.boundary, self.in_step

    def _forward_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        if self.world > 1 and self.steps_done < self.limit and self._peer_finished():
            # Another rank has taken its last step and this one has fewer: an
            # asymmetric script.  Stop here, before the forward's collectives.
            self._write(f"stopped after {self.steps_done} steps: another rank had finished", None)
            self._rendezvous_and_exit()
        if not (torch.is_grad_enabled() and module.training):
            return
        step, rank = self.steps_done + 1, self._virtual_rank()
        entry: dict[str, Any] = {
            "step": step,
            "rank": rank,
            "input": digest_bytes(*(tensor_digest(t).encode() for t in tensors_in((args, kwargs)))),
            "rng": rng_digests(),
            "draws": None,
        }
        if not any(m["step"] == step and m["rank"] == rank for m in self.record["micro"]):
            # The buffers this rank's step starts from (BatchNorm's statistics, when it has any).
            entry["buffers"] = {n: tensor_digest(b) for n, b in self.backend.unwrap(module).named_buffers()}
        self.record["micro"].append(entry)
        self.pending_forward = entry

    def _forward_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        entry = self.pending_forward
        if entry is not None and entry["draws"] is None:
            after = rng_digests()
            entry["draws"] = sorted(k for k, v in after.items() if entry["rng"].get(k) != v)
        self.pending_forward = None

    def _virtual_rank(self) -> int | None:
        if self.world_of is None:
            return self.rank
        return self.world_of.current_rank

    def saw_loss(self, loss: torch.Tensor) -> None:
        if self.done or self.steps_done >= self.limit:
            return
        try:
            value = float(loss.detach().float().mean().item())
        except (RuntimeError, ValueError):
            return
        self.record["losses"].append({"step": self.steps_done + 1, "rank": self._virtual_rank(), "loss": value})

    # ---------------------------------------------------------------- the step
    def at_boundary(self, optimizer: torch.optim.Optimizer) -> None:
        """The loop's boundary hook: the averaged, unscaled gradients before clipping."""
        if self.optimizers and optimizer is self.optimizers[0]:
            self._capture(optimizer)
            self.captured_at_boundary = True

    def _capture(self, optimizer: torch.optim.Optimizer) -> None:
        if self.done or self.steps_done >= self.limit:
            return
        grads = self.backend.grad_sync.averaged_gradients(optimizer)
        norms = {k: float(torch.linalg.vector_norm(g.double())) for k, g in grads.items()}
        self.capture = {
            "grad_norm": math.sqrt(sum(v * v for v in norms.values())),
            "grad_norms": norms,
            "grads": {k: tensor_digest(g) for k, g in grads.items()},
            "groups": hyperparameters(optimizer),
        }
        if self.steps_done == 0 and self.rank == 0 and self.records:
            self.first_grads = grads

    def _step_done(self, optimizer: torch.optim.Optimizer) -> None:
        if self.done:
            return
        self.steps_done += 1
        self.captured_at_boundary = False
        if self.world_of is not None:
            self.world_of.step_done()
        if self.steps_done > self.limit:
            return
        weights = self._weights()
        entry: dict[str, Any] = {"step": self.steps_done, **(self.capture or {"grad_norm": None})}
        entry["weights"] = {k: tensor_digest(v) for k, v in weights.items()}
        entry["seconds"] = time.monotonic() - self.started
        self.record["steps"].append(entry)
        self.capture = None
        if self.steps_done == 1 and self.first_grads is not None:
            torch.save(self.first_grads, self.folder / "grads.pt")
            self.first_grads = None
        if self.steps_done >= self.limit:
            self._write(f"stopped after {self.steps_done} optimizer steps", weights)
            self._rendezvous_and_exit()

    def made_average(self, average: Any) -> None:
        self.averages.append(average)

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every wrapped model's whole state (a collective where it is sharded), plain names; then
        each weight average's (``ema<i>.``), as it stood before this step's update."""
        out: dict[str, torch.Tensor] = {}
        for i, model in enumerate(self.models):
            for k, v in self.backend.model_state_dict(model).items():
                out[f"{i}.{k}" if i else k] = v
        for i, average in enumerate(self.averages):
            for k, v in average.model_state_dict().items():
                out[f"ema{i}.{k}"] = v
        return out

    # ---------------------------------------------------------------- ending the run
    def _write(self, why: str, weights: dict[str, torch.Tensor] | None) -> None:
        if self.done:
            return
        self.done = True
        self.record["stopped"] = why
        self.record["steps_done"] = self.steps_done
        self.record["options"] = {
            "accumulate": self.backend.options.accumulate,
            "clip_grad_norm": self.backend.options.clip_grad_norm,
            "precision": self.backend.options.precision,
            "grad_compression": self.backend.options.grad_compression,
        }
        if self.world_of is not None:
            self.record["reference"] = self.world_of.report()
        if not self.records:  # a tensor-parallel peer: its group's rank 0 records what they share
            return
        if weights is not None and self.rank == 0:
            torch.save(weights, self.folder / "weights.pt")
        if self.first_grads is not None:
            torch.save(self.first_grads, self.folder / "grads.pt")
        tmp = self.folder / f"rank{self.rank}.json.tmp"
        tmp.write_text(json.dumps(self.record))
        tmp.replace(self.folder / f"rank{self.rank}.json")

    def _peer_finished(self) -> bool:
        return any((self.folder / f"done-{r}").exists() for r in range(self.world) if r != self.process)

    def _rendezvous_and_exit(self) -> None:
        (self.folder / f"done-{self.process}").touch()
        end = time.monotonic() + self.wait
        while time.monotonic() < end:
            if all((self.folder / f"done-{r}").exists() for r in range(self.world)):
                break
            time.sleep(0.02)
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown: the process group, Horovod's and DeepSpeed's threads
        # would wait for ranks that have left.  The launcher's clean-up runs after.
        os._exit(0)


class ProbeWatcher(LoopWatcher):
    """Tells the probe of each loss, backward and step of the backend's own loop; in the
    reference it plays the virtual world's windows."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def view(self, loader: Iterable[Any], limit: int | None) -> tuple[Iterable[Any], int | None, LoopOptions | None]:
        world = self.probe.world_of
        loop = self.probe.backend.loop
        if world is None or loop is None:
            return loader, limit, None
        view, n = world.loader_view(loader)
        # Each window holds the N virtual ranks' micro-batches of a window, in turn.
        return view, None if limit is None else limit * n, world.window_options(loop.options, n)

    def before_backward(self, loss: torch.Tensor) -> None:
        self.probe.saw_loss(loss)
        self.probe.inside_backward = True

    def after_backward(self) -> None:
        self.probe.inside_backward = False

    def stepping(self, inside: bool) -> None:
        self.probe.in_step = inside


_PROBES: list[weakref.ref[Probe]] = []


def _patch_tensor_backward(probe: Probe) -> None:
    """``loss.backward()`` called by the script itself (the protocol form) is seen too."""
    _PROBES.append(weakref.ref(probe))
    if getattr(torch.Tensor.backward, "parallelx_check", False):
        return
    original: Callable[..., Any] = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        live = [p for ref in _PROBES if (p := ref()) is not None and not p.done and not p.inside_backward]
        scalar = self.dim() == 0 and self.is_floating_point()
        for p in live:
            if scalar:
                p.saw_loss(self)
            p.inside_backward = True
        try:
            return original(self, *args, **kwargs)
        finally:
            for p in live:
                p.inside_backward = False

    backward.parallelx_check = True  # type: ignore[attr-defined]
    torch.Tensor.backward = backward  # type: ignore[method-assign]
