"""Forwards that are collectives: every rank must run the same ones.

Under ``fsdp`` and DeepSpeed's ZeRO-3 a forward gathers the parameters from
every rank; under tensor parallelism the split layers sum their pieces over
the tensor-parallel group.  A script that evaluates or generates text on rank 0 alone
(``if rank == 0: evaluate(model)``) then pairs rank 0's gathers with whatever
rank 1 does next: the job hangs until the timeout (30 minutes by default), or
a later collective fails with an unrelated error.

:class:`ForwardLockstep` makes that one clear error instead.  Before each
forward of a sharded model, every rank says which forward it is about to run
(its count and its mode: training or evaluation, with or without gradients)
over a process group of its own, so this exchange never pairs with the
model's collectives.  When two ranks disagree, both raise at once, naming the
cause and the fix; a rank that is only late is waited for, as any collective
waits.  The cost is one small all-reduce per forward of a sharded model,
beside the all-gathers that forward does anyway.
"""

from __future__ import annotations

import datetime as _dt
import os

import torch
import torch.distributed as dist

from parallelx.errors import ParallelxError
from parallelx.forensics import record

#: ``$PARALLELX_FORWARD_LOCKSTEP=0`` leaves the check out: one all-reduce of 4 integers less per forward
#: (docs/benchmarks.md measures it); a rank-0-only forward then hangs until the timeout instead.
ENABLED = os.environ.get("PARALLELX_FORWARD_LOCKSTEP", "1") != "0"

#: The mark of a model whose forwards are checked (:meth:`ForwardLockstep.guard`).
_GUARDED = "_parallelx_lockstep"

#: How each mode is told apart in the exchange.
_MODES = {(True, True): 1, (True, False): 2, (False, True): 3, (False, False): 4}
_NAMES = {
    1: "training mode",
    2: "training mode under torch.no_grad()",
    3: "evaluation mode (model.eval()) with gradients",
    4: "evaluation mode (model.eval(), torch.no_grad())",
}


def side_group(timeout_s: float) -> dist.ProcessGroup | None:
    """A Gloo group of every rank for parallelx's own agreements before a collective
    (:meth:`parallelx.parts.collectives.Collectives.agree_`), apart from the group that the
    engines' collectives use: one rank's agreement then never pairs with another rank's gradient
    reduction (DDP's buckets inside ``backward``), it waits for the others as any collective does,
    and the verdict names both calls.  Every rank must call it at the same point (it makes a
    process group); None in a world of one process or without Gloo."""
    if not dist.is_initialized() or dist.get_world_size() <= 1 or not dist.is_gloo_available():
        return None
    group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
    assert isinstance(group, dist.ProcessGroup)  # every rank is in it
    return group


#: Why a sharded model's forward is a collective (the message's default).
GATHERS = "it gathers the parameters from every rank"


def fix(who: str, why: str = GATHERS) -> str:
    """How to do rank-0-only work with a sharded model."""
    return (
        f"under {who} every forward is a collective ({why}), so every rank "
        "must run the same forwards: evaluate on every rank, each on its shard of the data (MetricSums gives "
        "the exact figure), or, for work on rank 0 alone (generating text, a plot), take the whole weights "
        "first: `state = backend.model_state_dict(model)` on every rank, then on rank 0 load them into a plain "
        "copy of the model (`plain.load_state_dict(state)`) and use that"
    )


class ForwardLockstep:
    """Checks, before each forward of a sharded model, that every rank runs the same one.

    Every rank must create it at the same point (it makes a process group).  ``groups`` (lists of
    ranks that cover the world) checks within each group only: the ranks whose forwards talk to each
    other (a tensor-parallel group's), leaving other groups free to run other forwards."""

    def __init__(
        self, who: str, rank: int, timeout_s: float, *, groups: list[list[int]] | None = None, why: str = GATHERS
    ) -> None:
        self.who = who
        self.rank = rank
        self.why = why
        # Gloo on the CPU whatever the model's device: a few integers, apart from the model's own collectives.
        timeout = _dt.timedelta(seconds=timeout_s)
        if groups:  # every rank makes every group (torch requires it) and keeps its own
            group, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout, backend="gloo")
        else:
            group = dist.new_group(backend="gloo", timeout=timeout)
        assert isinstance(group, dist.ProcessGroup)  # this rank is in it
        self.group = group
        self.count = 0

    def guard(self, model: torch.nn.Module) -> None:
        """Check every forward of ``model``, before anything else runs in it; once per model, whichever
        part asks first (a split model that an engine then shards is checked once)."""
        if model.__dict__.get(_GUARDED):
            return
        model.__dict__[_GUARDED] = True
        model.register_forward_pre_hook(lambda m, args: self.check(m.training), prepend=True)

    def check(self, training: bool) -> None:
        """Raise on every rank when the ranks are about to run different forwards."""
        if not ENABLED:
            return
        self.count += 1
        mode = _MODES[(bool(training), torch.is_grad_enabled())]
        mine = torch.tensor([self.count, mode], dtype=torch.int64)
        # The largest and (negated) the smallest count and mode over the ranks, in one all-reduce.
        both = torch.cat([mine, -mine])
        with record.call("forward", _NAMES[mode], group="lockstep"):
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high_count, high_mode, low_count, low_mode = both.tolist()  # one read of the result
        low_count, low_mode = -low_count, -low_mode
        if high_count == low_count and high_mode == low_mode:
            return
        if high_mode != low_mode:
            other = high_mode if high_mode != mode else low_mode
            detail = (
                f"rank {self.rank} is about to run a forward in {_NAMES[mode]} while another rank runs one in "
                f"{_NAMES[other]}"
            )
        else:
            detail = (
                f"the ranks are at different forwards of the model (rank {self.rank} at number {self.count}, "
                f"the others between {low_count} and {high_count}): some rank ran forwards the others did not"
            )
        raise ParallelxError(f"{self.who}: {detail}; " + fix(self.who, self.why))
