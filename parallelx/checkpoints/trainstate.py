"""Training-state checkpoints: stop a run anywhere, resume it exactly.

Every rank calls both functions (gathering sharded state is collective)::

    path = parallelx.latest_checkpoint(run_dir)              # None on a fresh start
    if path is not None:
        info = parallelx.load_training_state(backend, path, model=model, optimizer=optimizer,
                                              scheduler=scheduler, sampler=sampler)
        counters = info["counters"]                            # what was passed to save
    parallelx.save_training_state(backend, run_dir, step=counters["global_step"], model=model,
                                  optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                                  counters=counters)

Layout, all plain PyTorch files that ``torch.load(path, weights_only=True)`` reads::

    <run_dir>/checkpoints/latest                  the newest complete checkpoint's name
    <run_dir>/checkpoints/step-00000120/state.pt  model, optimizer, scheduler, scaler, sampler, counters, meta
    <run_dir>/checkpoints/step-00000120/rng-rank0.pt, rng-rank1.pt, ...   one per rank

Written into a hidden directory, flushed, then renamed in one step and named
in ``latest``: a crash at any moment leaves the complete new checkpoint or
none, never touching the previous ones (the newest ``keep`` are kept).
``<run_dir>`` must be a directory that every rank sees.  The optimizer's state
is keyed by parameter name and gathered whole from backends that shard it, so
a checkpoint loads on any backend at any world size; a rank that has no RNG
state in it (the world grew) starts from rank 0's.

For an exact continuation give the DataLoader its own generator (every
``iter(loader)`` draws a seed from the global one), and with loader workers
pass ``sampler=sampler.state_dict(consumed=batches_done * batch_size)``.

Several models and optimizers go by name (a GAN, a teacher and a student)::

    parallelx.save_training_state(backend, run_dir, step=step, models={"gen": g, "disc": d},
                                  optimizers={"gen": g_opt, "disc": d_opt}, counters=counters)

An optimizer trains the model of its name, or of the longest name its own
begins with (``gen_opt`` trains ``gen``), or the only model.  Such a
checkpoint keeps each part under its name (``models``, ``optimizers``,
``schedulers``, ``samplers`` in ``state.pt``); a fitting backend's shards go
to ``parts/<model>/shards/``.  Weight averages (:class:`parallelx.EMA`) go by
name too, in either layout (``emas={"ema": ema}``): stored whole, resumed into
each rank's share.  :class:`parallelx.Checkpointer` does all of this for a loop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parallelx import log, storage
from parallelx.checkpoints import background, sharded
from parallelx.errors import ParallelxError, first_line
from parallelx.launching.environments import detect_environment
from parallelx.parts import portable as checkpoint

# The pure helpers on optimizer state by name belong to this module's documented interface too.
from parallelx.parts.state import (  # noqa: F401
    check_named_groups,
    indexed_optimizer_state,
    load_named_optimizer_state,
    named_from_indexed,
    named_optimizer_state,
    rng_state,
    set_rng_state,
)
from parallelx.parts.stateio import plain_key
from parallelx.storage import Location
from parallelx.training.ema import EMA, refuse_averaged_model
from parallelx.version import __version__

if TYPE_CHECKING:
    from parallelx.backend import Backend
    from parallelx.parts.sampler import ShardedSampler

#: Version of the layout of ``state.pt``; a reader refuses newer ones.
FORMAT_VERSION = 1
SUBDIR = "checkpoints"
LATEST = "latest"
STATE_FILE = "state.pt"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
#: Where a checkpoint of parts by name keeps each model's shards.
PARTS_DIR = "parts"
#: A checkpoint in an object store is complete once this record is in it, written last.
COMMIT = "commit.json"


@dataclass
class Parts:
    """What one checkpoint holds, by name.  ``named``: given as ``models=``,
    ``optimizers=``, ... (stored by name) rather than ``model=``,
    ``optimizer=``, ... (the one-model layout, unchanged since format 1)."""

    named: bool
    models: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, Any] = field(default_factory=dict)
    schedulers: dict[str, Any] = field(default_factory=dict)
    samplers: dict[str, Any] = field(default_factory=dict)
    #: optimizer name -> the name of the model it trains
    pairs: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        what: str,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        sampler: Any,
        models: Mapping[str, nn.Module] | None,
        optimizers: Mapping[str, Any] | None,
        schedulers: Mapping[str, Any] | None,
        samplers: Mapping[str, Any] | None,
    ) -> Parts:
        """The parts of a call to ``what``: one of each, or several by name (not both)."""
        named = any(x is not None for x in (models, optimizers, schedulers, samplers))
        if not named:
            if model is None or optimizer is None:
                raise ParallelxError(
                    f"{what} needs model= and optimizer= (or several by name: models={{...}}, optimizers={{...}})"
                )
            parts = cls(False, {"model": model}, {"optimizer": optimizer})
            parts.schedulers = {} if scheduler is None else {"scheduler": scheduler}
            parts.samplers = {} if sampler is None else {"sampler": sampler}
            parts.pairs = {"optimizer": "model"}
            return parts
        single = [n for n, x in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler)) if x is not None]
        if single or sampler is not None:
            raise ParallelxError(
                f"{what}: give the parts one of each ({', '.join(single or ['sampler'])}=...) or all by name "
                "(models={...}, optimizers={...}, schedulers={...}, samplers={...}), not both"
            )
        parts = cls(True, dict(models or {}), dict(optimizers or {}), dict(schedulers or {}), dict(samplers or {}))
        if not parts.models:
            raise ParallelxError(f"{what}: models={{...}} names no model; give at least one")
        parts.pairs = {name: _model_of(name, parts.models, what) for name in parts.optimizers}
        return parts


def _model_of(optimizer: str, models: Mapping[str, nn.Module], what: str) -> str:
    """The model an optimizer trains: of its own name, of the longest name its own begins with, or the only one."""
    if optimizer in models:
        return optimizer
    prefixes = [m for m in models if optimizer.startswith(m)]
    if prefixes:
        return max(prefixes, key=len)
    if len(models) == 1:
        return next(iter(models))
    raise ParallelxError(
        f"{what}: which model does optimizer {optimizer!r} train? Name it after its model "
        f"(one of {sorted(models)}, e.g. {sorted(models)[0] + '_optimizer'!r})"
    )


# ----------------------------------------------------------------- saving
def save_training_state(
    backend: Backend,
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    sampler: ShardedSampler | Mapping[str, Any] | None = None,
    counters: Mapping[str, int],
    loader_seed: int | None = None,
    keep: int = 3,
    extra: Mapping[str, Any] | None = None,
    models: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    schedulers: Mapping[str, Any] | None = None,
    samplers: Mapping[str, ShardedSampler | Mapping[str, Any]] | None = None,
    emas: Mapping[str, EMA] | None = None,
    asynchronous: bool = False,
) -> Location:
    """Write a complete training-state checkpoint for ``step`` under
    ``directory/checkpoints/`` and return its path.  **Every rank must call
    this.**  ``counters`` are the loop's integers (epoch, step in epoch, ...);
    ``sampler`` is a :class:`parallelx.ShardedSampler` or the dict its
    ``state_dict(consumed=...)`` returned.  The newest ``keep`` checkpoints
    are kept, older ones removed once the new one is complete.  ``extra`` is
    the main rank's own loop state (floats, lists, dicts: metrics so far),
    stored as given and returned by :func:`load_training_state`.  ``scaler``
    defaults to the backend's own (``backend.grad_scaler``, under 16-mixed).
    Several models, optimizers, schedulers and samplers go by name instead
    (``models={...}``, ``optimizers={...}``, ...; see the module's text).
    ``emas`` are weight averages (:class:`parallelx.EMA`) by name, in either layout.

    ``asynchronous=True``: each rank returns once its state is copied into CPU memory; the files are
    written in the background and the checkpoint is complete (published) some steps later
    (:mod:`parallelx.checkpoints.background`: :class:`parallelx.Checkpointer` follows it at each step,
    :func:`wait_for_checkpoint` waits for it).  The returned path is where it will be once complete.
    A save first waits for the previous one."""
    _require_initialized(backend)
    background.wait(backend)  # a save waits for the one in flight (a collective when there is one)
    parts = Parts.of(
        "save_training_state", model, optimizer, scheduler, sampler, models, optimizers, schedulers, samplers
    )
    scaler = backend.grad_scaler if scaler is None else scaler  # 16-mixed's loss scale resumes too
    if keep < 1:
        raise ParallelxError(f"save_training_state(keep=...) must be >= 1, got {keep}")
    if not isinstance(step, int) or step < 0:
        raise ParallelxError(f"save_training_state(step=...) must be an int >= 0, got {step!r}")
    counters = _check_counters(counters)
    if loader_seed is not None and not isinstance(loader_seed, int):
        raise ParallelxError(f"loader_seed must be an int or None, got {type(loader_seed).__name__}")
    root = storage.join(storage.location(directory), SUBDIR)
    name = f"step-{step:08d}"

    # Collectives first, in the same order on every rank.  A sharding backend may hand out its shards instead.
    io = backend.state_io
    model_states: dict[str, Any] = {}
    optim_states: dict[str, Any] = {}
    shards: dict[str, dict[str, Any]] = {}  # model name -> its shards and its optimizer's
    for key, m in parts.models.items():
        its = [o for o, owner in parts.pairs.items() if owner == key]
        found = io.sharded_state(m, parts.optimizers[its[0]]) if len(its) == 1 else None
        if found is not None:
            shards[key] = found
            model_states[key] = None
            optim_states[its[0]] = sharded.skeleton(found)
            continue
        model_states[key] = io.model_state_dict(m)
        for o in its:
            optim_states[o] = io.named_optimizer_state(m, parts.optimizers[o])
    ema_states = {n: e.state_dict() for n, e in _emas(backend, emas, parts).items()}  # whole (a collective)
    rng = rng_state()

    state: dict[str, Any] | None = None
    if backend.is_main():
        sampler_states = {n: _sampler_state(s) for n, s in parts.samplers.items()}
        scheduler_states = {n: checkpoint.to_cpu(s.state_dict()) for n, s in parts.schedulers.items()}
        types = {n: _optimizer_type(o) for n, o in parts.optimizers.items()}
        one = not parts.named  # the one-model layout: its keys in their order since format 1
        meta = _metadata(backend, types["optimizer"] if one else None, step)
        meta["sharded"] = bool(shards) if one else sorted(shards)
        if not one:
            meta.update(optimizers=types, pairs=parts.pairs)
        state = {
            "meta": meta,
            "model": model_states["model"] if one else None,
            "optimizer": optim_states["optimizer"] if one else None,
            "scheduler": scheduler_states.get("scheduler") if one else None,
            "scaler": None if scaler is None else checkpoint.to_cpu(scaler.state_dict()),
            "sampler": sampler_states.get("sampler") if one else None,
            "counters": counters,
            "loader_seed": loader_seed,
            "extra": None if extra is None else plain(extra, "extra"),
        }
        if ema_states:
            state["emas"] = ema_states
        if not one:
            state.update(models=model_states, optimizers=optim_states, schedulers=scheduler_states)
            state["samplers"] = sampler_states

    group = None
    if asynchronous:  # what the writer writes: copies no later update can reach
        # DCP's writes of the shards are collectives: the writer thread runs them over a group of its own.
        group = background.writer_group(backend) if shards else None
        staged = None
        try:
            # Every tensor copied, those the state parts gave too: some of them share memory with a live
            # tensor (a buffer, an optimizer's state on the CPU), which the next steps update in place.
            rng = background.stage(plain(rng))
            state = None if state is None else background.stage(plain(state))
            # The shards: each rank's local part, its layout kept (DTensor, ZeRO's runs), so DCP writes them later.
            shards = {key: background.stage(found, io.copy_shards) for key, found in shards.items()}
        except Exception as exc:  # a state that cannot be stored, or no memory to stage it in: on every rank
            staged = f"staging the checkpoint failed on rank {backend.rank}: {first_line(exc)}"
        _agree(backend, staged)

    if isinstance(root, str):
        # Each model's shards go under its own folder in the store (the writer stages them on the local disk).
        uploads = {f"{root}/{name}/{PARTS_DIR}/{k}" if parts.named else f"{root}/{name}": v for k, v in shards.items()}
        # Kept by the store itself: no environment's copy of a local folder (Ray Train's) to make.
        return _save_to_store(backend, root, name, rng, state, keep, step, asynchronous, uploads, group)

    # Rank 0 makes the temporary directory; every rank writes its files into it.
    tmp, error = None, None
    if backend.is_main():
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root)
        except OSError as exc:
            error = f"cannot create a checkpoint directory under {root}: {exc}"
    tmp, error = backend.broadcast((tmp, error), src=0)
    if error is not None:
        raise ParallelxError(error)
    assert tmp is not None  # error was None: rank 0 made it
    tmp_dir = Path(tmp)
    final = root / name

    def write_files() -> None:
        _write(plain(rng), tmp_dir / f"rng-rank{backend.rank}.pt")
        if state is not None:
            _write(plain(state), tmp_dir / STATE_FILE)

    def write_all() -> None:  # an asynchronous save's writer: the shards' copies (DCP, over its group), then the files
        for key, found in shards.items():
            sharded.write(found, tmp_dir / PARTS_DIR / key if parts.named else tmp_dir, group)
        write_files()

    def publish() -> None:  # rank 0, once every rank's files are on disk: the rename, then `latest`
        checkpoint.fsync_dir(tmp_dir)
        _publish(tmp_dir, final)
        _after_publish(root, name, keep)

    if asynchronous:
        return _in_background(backend, final, step, write_all, publish)
    mine = None
    try:
        for key, found in shards.items():  # every rank writes its own shards (a collective)
            sharded.write(found, tmp_dir / PARTS_DIR / key if parts.named else tmp_dir)
        write_files()
    except Exception as exc:  # reported to every rank below
        mine = f"writing the checkpoint failed on rank {backend.rank}: {checkpoint.write_failure(tmp_dir, exc)}"
    try:
        _agree(backend, mine)
    except ParallelxError:
        if backend.is_main():  # every rank is past its writes: the half-made directory can go
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    # Every file is on disk: rank 0 publishes the directory, then names it in `latest`.
    error = None
    if backend.is_main():
        try:
            publish()
        except Exception as exc:
            error = f"publishing checkpoint {final} failed: {type(exc).__name__}: {exc}"
    error = backend.broadcast(error, src=0)
    if error is not None:
        raise ParallelxError(error)
    if backend.environment is not None:  # (Ray Train keeps a copy)
        backend.environment.checkpoint_saved(final, step)
    return final


def wait_for_checkpoint(backend: Backend) -> None:
    """Wait until the checkpoint an ``asynchronous=True`` save is writing is complete (every rank
    calls it; nothing to do when none is in flight).  Raises on every rank if writing it failed.
    ``backend.shutdown()`` (the end of ``with backend:``) calls it."""
    background.wait(backend)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Location | None:
    """The newest complete checkpoint under ``directory/checkpoints/``, or None.

    ``latest`` names it; a half-written checkpoint is never complete
    (:func:`is_complete`), so it is never returned.  When ``latest`` is missing,
    names a checkpoint that is gone, or an older one than the newest complete one
    (a publishing stopped between the commit and ``latest``), the newest complete
    one is taken, with a warning.  ``directory`` may be a URL (``s3://bucket/run``): a missing
    bucket or a refused key is an error here, not a fresh start."""
    root = storage.join(storage.location(directory), SUBDIR)
    if isinstance(root, Path) and not root.is_dir():  # the copy a scheduler restarted this run with, if any
        return detect_environment().restored_checkpoint()
    storage.probe(root)
    pointer = storage.join(root, LATEST)
    complete = [storage.name(p) for _, p in _complete(root)]  # by step: the newest last
    if storage.is_file(pointer):
        name = storage.read_bytes(pointer).decode(errors="replace").strip()
        if name not in complete:
            log.warn(
                f"{storage.show(pointer)} names {name!r}, which is not a complete checkpoint; taking the newest one"
            )
        elif name != complete[-1]:  # its publishing stopped between the checkpoint's commit and `latest`
            log.warn(f"{storage.show(pointer)} names {name!r}, but {complete[-1]} is newer and complete; taking it")
    if complete:
        return storage.join(root, complete[-1])
    return detect_environment().restored_checkpoint() if isinstance(root, Path) else None


def is_complete(checkpoint: Location) -> bool:
    """Whether the checkpoint folder ``checkpoint`` is complete, the one test for every reader.
    A local one is published by a rename of its whole folder, so its final name holding
    ``state.pt`` says so; a store has no rename, and its commit record, written after every
    rank's files, says so."""
    if isinstance(checkpoint, str):
        return storage.is_file(storage.join(checkpoint, COMMIT))
    return (checkpoint / STATE_FILE).is_file()


# ---------------------------------------------------------------- loading
def load_training_state(
    backend: Backend,
    path: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    scaler: torch.amp.GradScaler | None = None,
    sampler: ShardedSampler | None = None,
    models: Mapping[str, nn.Module] | None = None,
    optimizers: Mapping[str, Any] | None = None,
    schedulers: Mapping[str, Any] | None = None,
    samplers: Mapping[str, ShardedSampler] | None = None,
    emas: Mapping[str, EMA] | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_training_state` (by any
    backend, at any world size) into the objects given.  **Every rank must call
    this.**  Returns ``{"counters": ..., "loader_seed": ..., "meta": ..., "extra": ...}``.
    This rank's random number generators are restored last, so that nothing
    loaded here draws from them afterwards.  A checkpoint of parts by name
    loads with the same names (``models={...}``, ...); parts it holds but
    not given are left out."""
    _require_initialized(backend)
    parts = Parts.of(
        "load_training_state", model, optimizer, scheduler, sampler, models, optimizers, schedulers, samplers
    )
    # The backend's own scaler (16-mixed) by default; a checkpoint written in
    # another precision has none, and the scaler then starts afresh.
    default_scaler = scaler is None
    scaler = backend.grad_scaler if scaler is None else scaler
    path = storage.location(path)
    if not is_complete(path) and storage.is_file(storage.join(path, ".metadata")):
        return _load_plain_dcp(backend, path, parts)
    state, rng, error = None, None, None
    try:
        state = _read_state(path)
        rng = _read_rng(path, backend.rank, state["meta"]["world_size"])
    except ParallelxError as exc:
        error = str(exc)
    # A rank that cannot read its files must not leave the others waiting in a collective.
    _agree(backend, error)
    assert state is not None and rng is not None
    meta = state["meta"]

    saved = _saved_parts(path, state, parts)
    for o in parts.pairs:
        _check_optimizer(path, saved.types.get(o), saved.optimizers[o], parts.optimizers[o])
    try:
        for name, m in parts.models.items():
            mine = [o for o, owner in parts.pairs.items() if owner == name]
            if name in saved.sharded:  # the backend's own slices of the shards, or the whole tensors
                where = storage.join(path, PARTS_DIR, name) if parts.named else path
                sharded.load(backend.state_io, where, m, parts.optimizers[mine[0]], saved.optimizers[mine[0]])
                continue
            _check_model(path, saved.models[name], m, backend)
            backend.state_io.load_model_state_dict(m, saved.models[name])
            for o in mine:
                backend.state_io.load_named_optimizer_state(m, parts.optimizers[o], saved.optimizers[o])
    except RuntimeError as exc:  # torch lists every mismatch over many lines: keep the first
        raise ParallelxError(f"checkpoint {path} does not fit this model: {first_line(exc)}") from None
    saved_emas = state.get("emas") or {}
    for name, ema in _emas(backend, emas, parts).items():
        if name not in saved_emas:
            raise ParallelxError(
                f"checkpoint {path} holds no weight average named {name!r} (it holds {sorted(saved_emas)}); "
                f"load it without emas[{name!r}]"
            )
        ema.load_state_dict(saved_emas[name])  # scattered into this rank's shares (local)
    for name, target in parts.schedulers.items():
        _load_optional(path, _what("scheduler", name, parts), target, saved.schedulers.get(name))
    if not (default_scaler and state["scaler"] is None):
        _load_optional(path, "scaler", scaler, state["scaler"])
    for name, target in parts.samplers.items():
        if saved.samplers.get(name) is None:
            what = _what("sampler", name, parts)
            raise ParallelxError(f"checkpoint {path} holds no {what} position; load it without {what}=...")
        target.load_state_dict(saved.samplers[name])
    if meta["world_size"] != backend.world_size:
        log.warn(
            f"checkpoint {path} was written by {meta['world_size']} rank(s), this run has "
            f"{backend.world_size}: the data order continues exactly; the weights continue with a "
            "different reduction order"
            + (
                ", and ranks that had no RNG state start from rank 0's"
                if backend.world_size > meta["world_size"]
                else ""
            )
        )
    set_rng_state(rng)  # last: nothing above may shift this rank's random numbers
    return {
        "counters": dict(state["counters"]),
        "loader_seed": state["loader_seed"],
        "meta": dict(meta),
        "extra": state.get("extra"),
    }


# ---------------------------------------------------------------- helpers
def _emas(backend: Backend, emas: Mapping[str, EMA] | None, parts: Parts) -> dict[str, EMA]:
    """The weight averages given, checked (and torch AveragedModels among the models refused where they cannot be)."""
    for name, m in parts.models.items():
        refuse_averaged_model(backend, m, f"training-state checkpoint, models[{name!r}]")
    found = dict(emas or {})
    wrong = [n for n, e in found.items() if not isinstance(e, EMA)]
    if wrong:
        raise ParallelxError(
            f"emas={{...}} takes parallelx.EMA objects; {wrong[0]!r} is a {type(found[wrong[0]]).__name__} "
            "(a torch AveragedModel goes with models={...}, where the backend keeps whole weights)"
        )
    return found


def _require_initialized(backend: Backend) -> None:
    if not backend.initialized:
        raise ParallelxError(f"backend {backend.name!r} is not initialised: call backend.init() first")


def _check_counters(counters: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(counters, Mapping):
        raise ParallelxError(f"counters must be a dict of str to int, got {type(counters).__name__}")
    bad = [k for k, v in counters.items() if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        raise ParallelxError(
            f"counters must map names to ints; not so for {bad[:3]}: give other loop state "
            "(floats such as a best accuracy, lists, dicts) as extra={...}"
        )
    return {k: int(v) for k, v in counters.items()}


def _optimizer_type(optimizer: Any) -> str:
    """The class name of the user's optimizer inside a backend's wrappers: each wrapper holds the
    optimizer it wraps as ``optimizer``, or as ``given`` where that is the user's own, held until an
    engine is built around it (DeepSpeed's ZeRO-3).  Read without building anything: rank 0 alone
    calls this."""
    inner = optimizer
    while True:
        attrs = getattr(inner, "__dict__", {})
        nested = next((attrs[k] for k in ("optimizer", "given") if checkpoint.is_optimizer(attrs.get(k))), None)
        if nested is None:
            return type(inner).__name__
        inner = nested


def _metadata(backend: Backend, optimizer_type: str | None, step: int) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "backend": backend.name,
        "world_size": backend.world_size,
        **backend.state_io.checkpoint_meta(),
        "optimizer": optimizer_type,
        "step": step,
        "torch": str(torch.__version__),
        "parallelx": __version__,
        "time": time.time(),
    }


def _sampler_state(sampler: ShardedSampler | Mapping[str, Any]) -> dict[str, Any]:
    return dict(sampler) if isinstance(sampler, Mapping) else dict(sampler.state_dict())


@dataclass
class _Saved:
    """A checkpoint's parts by name, whichever layout it has."""

    models: dict[str, Any]
    optimizers: dict[str, Any]
    types: dict[str, Any]
    schedulers: dict[str, Any]
    samplers: dict[str, Any]
    sharded: set[str]


def _saved_parts(path: Location, state: dict[str, Any], parts: Parts) -> _Saved:
    """``state``'s parts under the names ``parts`` uses; what is asked but not there is an error."""
    meta = state["meta"]
    named = isinstance(state.get("models"), Mapping)
    if named != parts.named:
        if named:
            raise ParallelxError(
                f"checkpoint {path} holds its parts by name (models {sorted(state['models'])}); load it with "
                "models={...}, optimizers={...} and the same names"
            )
        raise ParallelxError(
            f"checkpoint {path} holds one model and one optimizer; load it with model=... and optimizer=..."
        )
    if not named:
        return _Saved(
            {"model": state["model"]},
            {"optimizer": state["optimizer"]},
            {"optimizer": meta.get("optimizer")},
            {"scheduler": state["scheduler"]},
            {"sampler": state["sampler"]},
            {"model"} if meta.get("sharded") else set(),
        )
    saved = _Saved(
        dict(state["models"]),
        dict(state.get("optimizers") or {}),
        dict(meta.get("optimizers") or {}),
        dict(state.get("schedulers") or {}),
        dict(state.get("samplers") or {}),
        set(meta.get("sharded") or ()),
    )
    for kind, given, have in (
        ("models", parts.models, saved.models),
        ("optimizers", parts.optimizers, saved.optimizers),
    ):
        missing = sorted(set(given) - set(have))
        if missing:
            raise ParallelxError(f"checkpoint {path} holds no {kind} named {missing}; it holds {sorted(have)}")
    pairs = meta.get("pairs") or {}
    moved = {o: (m, pairs.get(o)) for o, m in parts.pairs.items() if pairs.get(o) != m}
    if moved:
        o, (m, was) = next(iter(moved.items()))
        raise ParallelxError(
            f"checkpoint {path}: optimizer {o!r} trained model {was!r} there and trains {m!r} here; "
            "keep the names the run was saved with"
        )
    return saved


def _what(kind: str, name: str, parts: Parts) -> str:
    """How an error names a part: ``scheduler``, or ``schedulers['warmup']``."""
    return f"{kind}s[{name!r}]" if parts.named else kind


def _write(obj: Any, path: Path) -> None:
    checkpoint.write_synced(path, lambda f: torch.save(obj, f))


def plain(obj: Any, where: str = "state") -> Any:
    """``obj`` made of what ``torch.load(weights_only=True)`` accepts: dicts,
    lists, tuples, tensors and plain scalars (subclasses such as torch's
    version string become their base type); anything else is an error that
    names where it is."""
    if isinstance(obj, torch.Tensor):
        return obj
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    for base in (bool, int, float, str):
        if isinstance(obj, base):
            return base(obj)
    if isinstance(obj, Mapping):
        return {plain(k, where): plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise ParallelxError(
        f"{where} holds a {type(obj).__name__}, which a weights_only checkpoint cannot store; "
        "keep only tensors, numbers, strings, lists and dicts in it"
    )


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished directory to its final name.  A checkpoint of the
    same step already there (a re-run) is first renamed aside, so the name
    always holds one complete checkpoint or, for an instant, none."""
    if final.exists():
        aside = final.parent / f".old-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(final, aside)
        os.rename(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    checkpoint.fsync_dir(final.parent)


def _write_latest(root: Location, name: str) -> None:
    storage.write_text(storage.join(root, LATEST), f"{name}\n")


def _after_publish(root: Location, name: str, keep: int) -> None:
    """``latest``, then the retention, once checkpoint ``name`` is complete.  Neither can make it less
    complete: a failure is a warning (a stale ``latest`` loses to the newest complete checkpoint in
    :func:`latest_checkpoint`; the next save prunes again), never the save's failure."""
    try:
        _write_latest(root, name)
        _prune(root, keep, name)
    except Exception as exc:
        log.warn(
            f"checkpoint {storage.show(storage.join(root, name))} is complete, but updating `latest` or removing "
            f"older checkpoints failed ({type(exc).__name__}: {first_line(exc)}); the next save tries again"
        )


def _complete(root: Location) -> list[tuple[int, Location]]:
    """The complete checkpoints under ``root``, by step."""
    found = []
    for entry in storage.listdir(root):
        m = _STEP_DIR.match(entry)
        if m and is_complete(storage.join(root, entry)):
            found.append((int(m.group(1)), storage.join(root, entry)))
    return sorted(found, key=lambda f: f[0])


def _in_background(backend: Backend, final: Location, step: int, write: Any, publish: Any) -> Location:
    """Hand the writes (every rank) and the publishing (rank 0, once all have written) to
    :mod:`parallelx.checkpoints.background`; return where the checkpoint will be."""

    def complete() -> None:
        # Ray Train keeps a copy of a local folder (a store keeps its own).
        if backend.environment is not None and isinstance(final, Path):
            backend.environment.checkpoint_saved(final, step)

    background.track(background.PendingSave(backend, final, write, publish, complete))
    return final


def _save_to_store(
    backend: Backend,
    root: str,
    name: str,
    rng: Any,
    state: dict[str, Any] | None,
    keep: int,
    step: int,
    asynchronous: bool,
    shards: dict[str, dict[str, Any]],
    group: Any,
) -> str:
    """Write a checkpoint into an object store, which has no rename: every rank puts its files
    under the final name (its shards first, ``shards``: folder in the store -> this rank's shards,
    written by DCP into a local staging folder over ``group``, then uploaded), and rank 0 writes the
    commit record once all have, then ``latest``.  Until then no reader takes it
    (:func:`is_complete`), and a crash leaves it incomplete."""
    final = f"{root}/{name}"
    error = None
    if backend.is_main():
        try:
            storage.probe(root)
            # A checkpoint of this step from an earlier run stops being complete before any file is replaced.
            storage.remove(f"{final}/{COMMIT}")
            storage.remove(final)
        except ParallelxError as exc:
            error = str(exc)
    error = backend.broadcast(error, src=0)
    if error is not None:
        raise ParallelxError(error)

    def write_files() -> None:
        for folder, found in shards.items():  # DCP's collective over group, on every rank; a full disk ends it on all
            sharded.upload(sharded.stage(found, group), folder)
        storage.save(plain(rng), f"{final}/rng-rank{backend.rank}.pt")
        if state is not None:
            storage.save(plain(state), f"{final}/{STATE_FILE}")

    def publish() -> None:  # rank 0, once every rank's files are in the store: the commit record, then `latest`
        record = {"name": name, "world_size": backend.world_size, "time": time.time()}
        storage.write_text(f"{final}/{COMMIT}", json.dumps(record) + "\n")
        _after_publish(root, name, keep)

    if asynchronous:
        return str(_in_background(backend, final, step, write_files, publish))
    mine = None
    try:
        write_files()
    except Exception as exc:  # reported to every rank below
        mine = f"writing the checkpoint {storage.show(final)} failed on rank {backend.rank}: {first_line(exc)}"
    _agree(backend, mine)  # every rank's files are in the store
    error = None
    if backend.is_main():
        try:
            publish()
        except Exception as exc:
            error = f"publishing checkpoint {storage.show(final)} failed: {first_line(exc)}"
    error = backend.broadcast(error, src=0)
    if error is not None:
        raise ParallelxError(error)
    return final


def _prune(root: Location, keep: int, newest: str) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and what crashed
    writes left behind.  Locally each is first renamed to a hidden name (atomic), so
    an interrupted removal never leaves a damaged checkpoint under a final name; in a
    store its commit record goes first, for the same reason.  An incomplete checkpoint
    in a store is left alone: it may be one still being written."""
    complete = _complete(root)
    old = [p for _, p in complete if storage.name(p) != newest][: max(0, len(complete) - keep)]
    if isinstance(root, str):
        for p in old:
            storage.remove(storage.join(p, COMMIT))
            storage.remove(p)
        return
    leftovers = [p for p in root.iterdir() if p.name.startswith((".tmp-", ".old-", ".del-"))]
    for p in old:
        assert isinstance(p, Path)
        aside = root / f".del-{p.name}-{os.getpid()}"
        os.rename(p, aside)
        leftovers.append(aside)
    for p in leftovers:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _agree(backend: Backend, error: str | None) -> None:
    """Raise on every rank when any rank failed (a collective)."""
    failed = torch.tensor([0 if error is None else 1])
    if backend.world_size > 1:
        failed = backend.all_reduce(failed, op="max")
    if int(failed.item()):
        raise ParallelxError(error or "another rank failed to read or write the checkpoint (see its error)")


def _load_plain_dcp(backend: Backend, path: Location, parts: Parts) -> dict[str, Any]:
    """A checkpoint that plain ``torch.distributed.checkpoint`` code wrote (PyTorch's FSDP2 example:
    ``dcp.save({"model": get_model_state_dict(...), "optim": get_optimizer_state_dict(...)})``): the
    model's and the optimizer's state by parameter name, read whole by every rank and cut as this
    backend keeps them.  It holds no counters, sampler or generator states: those start afresh."""
    if parts.named or len(parts.optimizers) > 1:
        raise ParallelxError(
            f"{storage.show(path)} is a plain torch.distributed.checkpoint folder: it loads into one model and "
            "its optimizer (model=, optimizer=)"
        )
    error, found = None, None
    try:
        found = sharded.read_folder(path)
    except ParallelxError as exc:  # every rank alike: none is left in a collective
        error = str(exc)
    except Exception as exc:
        error = f"reading {storage.show(path)} failed on rank {backend.rank}: {first_line(exc)}"
    _agree(backend, error)
    assert found is not None
    model_state = found.get("model")
    optim_state = found.get("optim", found.get("optimizer"))
    if not isinstance(model_state, dict):
        raise ParallelxError(f"{storage.show(path)}: no model state in it (expected the key 'model')")
    model = parts.models.get("model")
    if model is not None:
        backend.state_io.load_model_state_dict(model, model_state)
    optimizer = parts.optimizers.get("optimizer")
    if optimizer is not None and model is not None:
        if not isinstance(optim_state, dict) or "param_groups" not in optim_state:
            raise ParallelxError(
                f"{storage.show(path)}: no optimizer state in it (expected 'optim' or 'optimizer', as "
                "get_optimizer_state_dict gives it)"
            )
        backend.state_io.load_named_optimizer_state(model, optimizer, optim_state)
    return {"counters": {}, "loader_seed": None, "meta": {"format": "torch.distributed.checkpoint"}, "extra": None}


def _read_state(path: Location) -> dict[str, Any]:
    if not is_complete(path):
        what = STATE_FILE if isinstance(path, Path) else f"{COMMIT}: not committed"
        raise ParallelxError(
            f"{storage.show(path)} is not a complete checkpoint directory (no {what}); "
            "use parallelx.latest_checkpoint(run_dir) to find one"
        )
    state = storage.load(storage.join(path, STATE_FILE))
    keys = ("meta", "model", "optimizer", "scheduler", "scaler", "sampler", "counters", "loader_seed")
    if not isinstance(state, dict) or any(k not in state for k in keys) or not isinstance(state["meta"], dict):
        raise ParallelxError(f"checkpoint {storage.join(path, STATE_FILE)} is not a parallelx training state")
    version = state["meta"].get("format")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ParallelxError(
            f"checkpoint {path} has format {version!r}; this parallelx reads format "
            f"{FORMAT_VERSION} and older: upgrade parallelx"
        )
    return state


def _read_rng(path: Location, rank: int, saved_world: int) -> dict[str, Any]:
    """This rank's RNG state; a rank beyond the saved world takes rank 0's
    (the policy: parallelx seeds every rank alike, so rank 0's state is what
    that rank would have had)."""
    source = rank if rank < saved_world else 0
    state = storage.load(storage.join(path, f"rng-rank{source}.pt"))
    if not isinstance(state, dict) or any(k not in state for k in ("python", "numpy", "torch", "cuda")):
        raise ParallelxError(f"checkpoint {storage.join(path, f'rng-rank{source}.pt')} is not an RNG state")
    return state


def _check_model(path: Location, saved: Mapping[str, Any], model: nn.Module, backend: Backend) -> None:
    live = {plain_key(k) for k in backend.unwrap(model).state_dict()}
    if set(saved) != live:
        missing, extra = sorted(live - set(saved))[:3], sorted(set(saved) - live)[:3]
        raise ParallelxError(
            f"checkpoint {path} is of another model: not saved {missing}, not in this model "
            f"{extra} ({len(saved)} entries saved, {len(live)} here)"
        )


def _check_optimizer(path: Location, saved_type: Any, saved: Mapping[str, Any], optimizer: Any) -> None:
    mine = _optimizer_type(optimizer)
    if saved_type != mine:
        raise ParallelxError(
            f"checkpoint {path} holds the state of a {saved_type} optimizer, this "
            f"run uses {mine}; resume with the optimizer the run was saved with"
        )
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        raise ParallelxError(f"checkpoint {path} holds no usable optimizer state")


def _load_optional(path: Location, what: str, target: Any, state: Any) -> None:
    if target is None:
        return
    if state is None:
        raise ParallelxError(f"checkpoint {path} holds no {what} state; load it without {what}=...")
    try:
        target.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise ParallelxError(
            f"checkpoint {path}: the {what} state does not fit this {what} ({type(target).__name__}): {first_line(exc)}"
        ) from None
