"""One sentence from every rank's record: which rank, which call, which line, and the fix.

:func:`verdict` is pure (states in, text out), so every rank that reads the same states
prints the same words, and the tests feed it records without launching anything.  A
rank's state is the dict :func:`parallelx.forensics.exchange.state` publishes; ``None``
stands for a rank that did not answer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

State = Mapping[str, Any]

#: The fixes, by cause.
FIX_EVAL = (
    "evaluate on every rank, each on its shard of the data (MetricSums gives the exact figure), or for work "
    "on rank 0 alone take the whole weights first (`state = backend.model_state_dict(model)` on every rank, "
    "then load them into a plain copy of the model on rank 0)"
)
FIX_SAVE = (
    "call backend.save(...) on every rank, outside `if backend.is_main:` (gathering sharded state is a "
    "collective; rank 0 alone writes the file)"
)
FIX_BRANCH = (
    "a collective (all_reduce, broadcast, barrier, gather, save, a sharded forward) sits in a branch that only "
    "some ranks take (`if backend.is_main:`, `if rank == 0:`, a data-dependent `if`/`break`): call it on every "
    "rank, or move it out of the branch"
)
FIX_BUILD = (
    "an engine is built by the first call that needs it (DeepSpeed ZeRO-3: the first forward, "
    "optimizer.step(), zero_grad() or state_dict(), a checkpoint, a weight average), and the build is a "
    "collective: make that first call on every rank, outside `if backend.is_main:`"
)
FIX_SHAPES = (
    "every rank must pass a tensor of the same shape and dtype (gather rows of different lengths with "
    "backend.all_gather, which pads them, or agree on the size first)"
)
#: Added to :data:`FIX_BRANCH` when the other ranks are in the engine's own traffic.
IN_THE_LOOP = (
    "; inside a training loop such a call meets the other ranks' backward, optimizer step or sharded forward, "
    "which are collectives too (the engine reduces the gradients or gathers the parameters in them)"
)
FIX_RAISED = "the exception on that rank is the cause: its traceback is in that rank's output above"
FIX_SLOW = (
    "that rank is busy outside the calls parallelx records (sleeping, loading data, evaluating or writing on its "
    "own, stuck in a loop, or inside an engine's own collective, such as a ZeRO optimizer.step() that only some "
    "ranks call): do such work on every rank, or raise --timeout above the slowest rank's extra time"
)
FIX_GONE = "its process ended or froze without a word: look for it in the launcher's output (killed, out of memory)"


#: The calls in which an engine's own collectives run (``parallelx.parts.loop``, a sharded forward).
ENGINE_KINDS = frozenset({"backward", "the optimizer step", "forward"})


def _call(c: Mapping[str, Any] | None) -> str:
    if not c:
        return "no collective"
    name = "the model's forward" if c.get("kind") == "forward" else str(c.get("kind"))
    detail = c.get("detail") or ""
    text = f"{name} #{c.get('seq')}"
    if detail and c.get("kind") == "forward":
        text += f" in {detail}"
    return f"{text} ({c.get('where', '?')})"


def _in(state: State) -> str:
    """The call a waiting rank is in, and the call of the script's that it is part of."""
    call, outer = state.get("call"), state.get("outer")
    text = _call(call)
    if call and outer and outer.get("seq") != call.get("seq"):
        name = "the model's forward" if outer.get("kind") == "forward" else outer.get("kind")
        text = text[: text.rindex(" (")] + f" inside {name} #{outer.get('seq')} ({outer.get('where', '?')})"
    return text


def _shapes(c: Mapping[str, Any]) -> str:
    shapes = c.get("shapes") or []
    inner = ", ".join("[" + ", ".join(str(n) for n in s) + "]" for s in shapes)
    return inner + (f" {c['dtype']}" if c.get("dtype") else "")


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0, 2``, ``ranks 1-7, 9``: runs of three or more as a range, so that a
    verdict at 64 ranks stays one readable line."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)


def _is(ranks: list[int]) -> str:
    return "is" if len(ranks) == 1 else "are"


def _ran_other_code(groups: dict[tuple[Any, ...], list[int]], states: Mapping[int, State]) -> list[int]:
    """The ranks whose call is at a (kind, line) the other ranks never entered; the smallest group
    when that does not decide."""
    odd: list[int] = []
    for ranks in groups.values():
        call = states[ranks[0]]["call"]
        site = f"{call['kind']}@{call['where']}"
        others = [r for r in states if r not in ranks and states[r] is not None]
        if others and all(site not in (states[r].get("sites") or {}) for r in others):
            odd.extend(ranks)
    if odd and len(odd) < len(states):
        return sorted(odd)
    smallest = min(groups.values(), key=lambda rs: (len(rs), rs))
    return sorted(smallest) if len(smallest) * 2 <= len(states) else []


def verdict(states: Mapping[int, State | None]) -> str:
    """The verdict over every rank's state (``states[rank]``; None: the rank did not answer)."""
    answered = {r: s for r, s in states.items() if s is not None}
    silent = sorted(r for r, s in states.items() if s is None)
    raised = sorted(r for r, s in answered.items() if s.get("status") == "raised")
    waiting = sorted(r for r, s in answered.items() if s.get("status") == "waiting")
    running = sorted(r for r, s in answered.items() if s.get("status") in ("running", "done"))
    waiters = "; ".join(
        f"rank {r} waits in {_in(answered[r])} for {answered[r].get('waited', 0):.0f} s" for r in waiting
    )
    tail = f" while {waiters}" if waiters else ""

    if raised and len(raised) == len(states):
        errors = {(answered[r].get("error"), answered[r].get("error_where")) for r in raised}
        if len(errors) == 1:  # the same error on every rank: its own words name the cause and the fix
            s = answered[raised[0]]
            where = f"in {_call(s['call'])}" if s.get("call") else f"at {s.get('error_where', '?')}"
            return f"every rank raised {s.get('error')} {where}"
    if raised:
        errs: dict[tuple[str, str], list[int]] = {}
        for r in raised:
            errs.setdefault((answered[r].get("error", "an exception"), answered[r].get("error_where", "?")), []).append(
                r
            )
        parts = [f"{_ranks(rs)} raised {err.split(':', 1)[0]} at {where}" for (err, where), rs in errs.items()]
        first = next(iter(errs))[0]
        detail = first.split(":", 1)[1].strip() if ":" in first else ""
        detail = f" ({detail[:160]})" if detail else ""
        return f"{'; '.join(parts)}{detail}{tail}: {FIX_RAISED}"

    if running:
        parts = []
        for r in running:
            s = answered[r]
            text = f" `{s['text']}`" if s.get("text") else ""
            last = s.get("last")
            since = (
                f", {s.get('ago', 0):.0f} s after its last collective {_call(last)}"
                if last
                else ", before any collective"
            )
            parts.append(f"rank {r} never arrived: it is at {s.get('now', '?')}{text}{since}")
        return f"{'; '.join(parts)}{tail}: {FIX_SLOW}"

    if silent:
        return f"{_ranks(silent)} did not answer{tail}: {FIX_GONE}"

    # Everyone waits: in the same call, or in different ones.
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r in waiting:
        c = answered[r]["call"]
        groups.setdefault((c["kind"], c["seq"], c["where"]), []).append(r)
    if len(groups) == 1:
        shaped: dict[str, list[int]] = {}
        for r in waiting:
            shaped.setdefault(_shapes(answered[r]["call"]), []).append(r)
        c = answered[waiting[0]]["call"]
        if len(shaped) > 1:
            which = " but ".join(f"{_ranks(rs)} passed {sh}" for sh, rs in shaped.items())
            return f"every rank is in {_call(c)} with different shapes: {which}: {FIX_SHAPES}"
        return (
            f"every rank is in {_call(c)} and has waited {min(answered[r].get('waited', 0) for r in waiting):.0f} s: "
            "the ranks agree on the call, so the transport itself is slow or stuck (a lost connection, an "
            "overloaded machine)"
        )
    descr = [f"{_ranks(rs)} {_is(rs)} in {_in(answered[rs[0]])}" for rs in groups.values()]
    odd = _ran_other_code(groups, answered)
    why = f"{_ranks(odd)} ran code the others did not" if odd else "the ranks ran different code before this point"
    # The fix is the odd ranks' (a rank-0-only collective meeting the others' forward is a branch, not
    # an evaluation); every rank's where no rank stands out.
    culprits = odd or waiting
    kinds = {answered[r]["call"]["kind"] for r in culprits}
    outers = {(answered[r].get("outer") or {}).get("kind") for r in culprits}
    engine = {answered[r]["call"]["kind"] for r in waiting if r not in culprits} & ENGINE_KINDS
    if "engine build" in kinds:
        fix = FIX_BUILD
    elif "forward" in kinds:
        fix = f"a forward of a sharded model on some ranks only (rank-0-only evaluation): {FIX_EVAL}"
    elif "save" in kinds or "save" in outers:
        fix = f"a save inside `if backend.is_main:`: {FIX_SAVE}"
    else:
        fix = FIX_BRANCH + (IN_THE_LOOP if engine else "")
    first, *others = descr
    if others:  # "A while B", "A while B and C", "A while B, C and D"
        first += " while " + " and ".join(filter(None, [", ".join(others[:-1]), others[-1]]))
    return f"{first}: {why}; {fix}"
