"""A recipe with faults injected, for the resume, elastic, multi-node, Slurm and Ray tests.

Runs ``recipes.<PXT_RECIPE>.main()`` (``cifar10`` by default, or ``dogcat``)
unchanged.  The faults are driven from outside the recipe, through what every
training script calls: parallelx's ``Backend.step`` (after each optimizer
step), its checkpoint file writes, and the samplers' passes (a pass of a
sampler that does not shuffle is a validation pass).  What happens is set by
the environment:

``PXT_ACTIONS``  ``attempt:what@k:rank`` items separated by ``;``, where
                 attempt is ``TORCHELASTIC_RESTART_COUNT`` (0 without torchrun),
                 what is
                 ``kill``   SIGKILL this process after its k-th optimizer step;
                 ``term``   SIGTERM to this process after its k-th optimizer step
                            (a preemption that reached one rank only);
                 ``write``  SIGKILL in the middle of its k-th checkpoint file write
                            (the file is half written, not yet published);
                 ``val``    SIGKILL at the start of its k-th validation pass.
``PXT_DELAY``    seconds to sleep after every optimizer step (so that a test
                 can act from outside while the job runs); ``attempt:seconds``
                 in that attempt only.
``PXT_SAMPLES``  a folder: each rank appends the dataset indices it trains on there
                 (with loader workers the sampler runs ahead of training: use it
                 with ``--num-workers 0``).
``PXT_PIDS``     a folder: this process writes ``rank<R>-attempt<A>.pid`` there.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parallelx.checkpoints.trainstate
from parallelx import Backend, ShardedSampler

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK") or os.environ.get("HOROVOD_RANK") or "0")


def _actions() -> dict[str, int]:
    """``{what: k}`` for this attempt and rank."""
    found = {}
    for item in filter(None, os.environ.get("PXT_ACTIONS", "").split(";")):
        attempt, rest = item.split(":", 1)
        what_k, rank = rest.rsplit(":", 1)
        what, k = what_k.split("@")
        if int(attempt) == ATTEMPT and int(rank) == RANK:
            found[what] = int(k)
    return found


ACTIONS = _actions()


def _delay() -> float:
    """``PXT_DELAY``'s seconds for this attempt (``attempt:seconds``: that attempt's only)."""
    value = os.environ.get("PXT_DELAY", "0")
    attempt, _, seconds = value.rpartition(":")
    return float(seconds) if not attempt or int(attempt) == ATTEMPT else 0.0


DELAY = _delay()
_count = {"step": 0, "write": 0, "val": 0}


def _die(why: str) -> None:
    print(f"resume_wrapper: rank {RANK} attempt {ATTEMPT}: {why}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


_step = Backend.step


def step(self, optimizer, scheduler=None):  # type: ignore[no-untyped-def]
    result = _step(self, optimizer, scheduler)
    if result is not None:
        _count["step"] += 1
        if ACTIONS.get("kill") == _count["step"]:
            _die(f"SIGKILL after step {_count['step']}")
        if ACTIONS.get("term") == _count["step"]:
            print(f"resume_wrapper: rank {RANK} attempt {ATTEMPT}: SIGTERM after step {_count['step']}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
        if DELAY:
            time.sleep(DELAY)
    return result


_write = parallelx.checkpoints.trainstate._write


def write(obj, path):  # type: ignore[no-untyped-def]
    _count["write"] += 1
    if ACTIONS.get("write") == _count["write"]:
        with open(path, "wb") as f:  # what a write cut short leaves behind
            f.write(b"PK\x03\x04 half a checkpoint")
            f.flush()
        _die(f"SIGKILL while writing {path}")
    return _write(obj, path)


SAMPLES = os.environ.get("PXT_SAMPLES")
_iter = ShardedSampler.__iter__


def logged(sampler: ShardedSampler, indices):  # type: ignore[no-untyped-def]
    """The indices of a training pass, each real one (the padding duplicates
    left out) appended to ``PXT_SAMPLES/samples-<pid>.txt`` as an ``epoch
    index`` line as the loader draws it: how the tests see that a resumed
    epoch trains on every sample exactly once.  The epoch is the recipe's
    (1-based) one, the sampler's pass plus one."""
    Path(SAMPLES).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
    epoch = sampler.last_epoch + 1  # type: ignore[operator]
    with open(Path(SAMPLES) / f"samples-{os.getpid()}.txt", "a") as log:  # type: ignore[arg-type]
        for position, index in enumerate(indices):
            if position < sampler.num_real:
                log.write(f"{epoch} {index}\n")
                log.flush()
            yield index


def sampler_iter(self):  # type: ignore[no-untyped-def]
    indices = _iter(self)
    if not self.shuffle:  # the recipes' validation sampler
        _count["val"] += 1
        if ACTIONS.get("val") == _count["val"]:
            _die(f"SIGKILL at the start of validation pass {_count['val']}")
        return indices
    return logged(self, indices) if SAMPLES else indices


Backend.step = step  # type: ignore[method-assign]
parallelx.checkpoints.trainstate._write = write
ShardedSampler.__iter__ = sampler_iter  # type: ignore[method-assign]

if os.environ.get("PXT_PIDS"):
    Path(os.environ["PXT_PIDS"]).mkdir(parents=True, exist_ok=True)
    (Path(os.environ["PXT_PIDS"]) / f"rank{RANK}-attempt{ATTEMPT}.pid").write_text(str(os.getpid()))

if __name__ == "__main__":
    sys.exit(importlib.import_module(f"recipes.{os.environ.get('PXT_RECIPE', 'cifar10')}").main())
