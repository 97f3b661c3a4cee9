"""A recipe with faults injected, for tests/system/test_resume.py and test_multinode.py.

Runs ``recipes.<PXT_RECIPE>.main()`` (``cifar10`` by default, or ``dogcat``)
unchanged, after patching three places to fail on purpose, as the
environment says:

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
                 can act from outside while the job runs).
``PXT_SAMPLES``  a folder: each rank appends the dataset indices it trains on there.
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

import parallelx.trainstate
import recipes.engine
from parallelx.protocol import Backend

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
DELAY = float(os.environ.get("PXT_DELAY", "0"))
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


_write = parallelx.trainstate._write


def write(obj, path):  # type: ignore[no-untyped-def]
    _count["write"] += 1
    if ACTIONS.get("write") == _count["write"]:
        with open(path, "wb") as f:  # what a write cut short leaves behind
            f.write(b"PK\x03\x04 half a checkpoint")
            f.flush()
        _die(f"SIGKILL while writing {path}")
    return _write(obj, path)


_run_epoch = recipes.engine.run_epoch
SAMPLES = os.environ.get("PXT_SAMPLES")


class LoggedLoader:
    """The training loader, appending each batch's real dataset indices (the
    sampler's padding left out) to ``PXT_SAMPLES/samples-<pid>.txt`` as
    ``epoch i j k ...`` lines: how the tests see that a resumed epoch trains
    on every sample exactly once."""

    def __init__(self, loader, epoch: int) -> None:  # type: ignore[no-untyped-def]
        self.loader, self.epoch = loader, epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.loader, name)

    def __iter__(self):  # type: ignore[no-untyped-def]
        sampler = recipes.engine._sharded(self.loader)
        position = 0
        Path(SAMPLES).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
        with open(Path(SAMPLES) / f"samples-{os.getpid()}.txt", "a") as log:  # type: ignore[arg-type]
            for batch in self.loader:
                real = sampler.real_mask(position, len(batch[1]))
                log.write(f"{self.epoch} {' '.join(str(int(i)) for i in batch[2][real])}\n")
                log.flush()
                position += len(batch[1])
                yield batch


def run_epoch(backend, model, loader, *args, **kwargs):  # type: ignore[no-untyped-def]
    if kwargs.get("optimizer") is None:
        _count["val"] += 1
        if ACTIONS.get("val") == _count["val"]:
            _die(f"SIGKILL at the start of validation pass {_count['val']}")
    elif SAMPLES:
        loader = LoggedLoader(loader, kwargs.get("epoch", 0))
    return _run_epoch(backend, model, loader, *args, **kwargs)


Backend.step = step  # type: ignore[method-assign]
parallelx.trainstate._write = write
recipes.engine.run_epoch = run_epoch

if os.environ.get("PXT_PIDS"):
    Path(os.environ["PXT_PIDS"]).mkdir(parents=True, exist_ok=True)
    (Path(os.environ["PXT_PIDS"]) / f"rank{RANK}-attempt{ATTEMPT}.pid").write_text(str(os.getpid()))

if __name__ == "__main__":
    sys.exit(importlib.import_module(f"recipes.{os.environ.get('PXT_RECIPE', 'cifar10')}").main())
