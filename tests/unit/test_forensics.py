"""The record of each rank's collectives and the verdict read from every rank's record (in-process)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from parallelx.errors import ParallelxError
from parallelx.forensics import exchange, record, verdict
from parallelx.forensics.record import Recorder


def test_calls_get_sequence_numbers_kinds_shapes_and_the_users_line() -> None:
    rec = Recorder(keep=3)
    with rec.call("all_reduce"):
        rec.describe([torch.zeros(2, 3)])
        line = f"test_forensics.py:{_here() - 2}"
    with rec.call("backward", "the gradient all-reduce"), rec.call("broadcast"):  # nested: a number of its own
        assert rec.current() is not None and rec.current().kind == "broadcast"
        assert rec.oldest_open() is not None and rec.oldest_open().kind == "backward"
    done = rec.history()
    assert [(c.seq, c.kind) for c in done] == [(1, "all_reduce"), (3, "broadcast"), (2, "backward")]
    assert done[0].where == line
    assert done[0].shapes == ((2, 3),) and done[0].dtype == "float32"
    assert rec.current() is None
    for _ in range(5):
        with rec.call("barrier"):
            pass
    assert len(rec.history()) == 3 and rec.history()[-1].seq == 8  # a ring of 3
    assert rec.sites[f"barrier@test_forensics.py:{_here() - 3}"] == 5


def test_the_users_line_skips_parallelx_and_torch_frames() -> None:
    # Run.watch (parallelx) inside a torch-style call chain: the line is this test's.
    from parallelx.strategy import Options, Run

    run = Run("ddp", Options(timeout=30))
    with run.watch("backward (the gradient all-reduce)") as entry:
        pass
    assert entry.kind == "backward" and entry.detail == "the gradient all-reduce"
    assert entry.where == f"test_forensics.py:{_here() - 3}"


def test_an_error_out_of_a_call_is_kept_on_it() -> None:
    rec = Recorder()
    with pytest.raises(RuntimeError), rec.call("all_reduce"):
        raise RuntimeError("Gloo timed out")
    assert isinstance(rec.last().failed, RuntimeError)  # type: ignore[union-attr]


def _here() -> int:
    import inspect

    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None
    return frame.f_back.f_lineno


# ------------------------------------------------------------------ verdicts
def waiting(rank: int, kind: str, seq: int, where: str, **kw: Any) -> dict[str, Any]:
    call = {"seq": seq, "kind": kind, "where": where, "detail": kw.pop("detail", ""), "shapes": kw.pop("shapes", [])}
    call["dtype"] = kw.pop("dtype", "")
    return {
        "rank": rank,
        "status": "waiting",
        "call": call,
        "outer": call,
        "waited": 12.0,
        "sites": kw.pop("sites", {}),
    }


def test_verdict_rank_zero_evaluates_alone() -> None:
    states = {
        0: waiting(0, "forward", 40, "train.py:312", detail="evaluation mode (model.eval(), torch.no_grad())"),
        1: waiting(1, "broadcast", 40, "train.py:288", sites={"forward@train.py:250": 11}),
    }
    text = verdict.verdict(states)
    assert text.startswith(
        "rank 0 is in the model's forward #40 in evaluation mode (model.eval(), torch.no_grad()) (train.py:312) "
        "while rank 1 is in broadcast #40 (train.py:288): rank 0 ran code the others did not"
    ), text
    assert "evaluate on every rank" in text


def test_verdict_a_collective_in_a_branch_and_a_save_inside_is_main() -> None:
    states = {
        0: waiting(0, "all_reduce", 7, "train.py:50", sites={"all_reduce@train.py:50": 1}),
        1: waiting(1, "barrier", 7, "train.py:60", sites={"barrier@train.py:60": 1}),
    }
    assert "rank 0 is in all_reduce #7 (train.py:50) while rank 1 is in barrier #7 (train.py:60)" in verdict.verdict(
        states
    )
    assert verdict.FIX_BRANCH in verdict.verdict(states)
    saving = waiting(0, "all_gather", 9, "train.py:70")
    saving["outer"] = {"seq": 8, "kind": "save", "where": "train.py:70"}
    text = verdict.verdict({0: saving, 1: waiting(1, "barrier", 8, "train.py:80")})
    assert "rank 0 is in all_gather #9 inside save #8 (train.py:70)" in text and verdict.FIX_SAVE in text


def test_verdict_a_collective_on_one_rank_meets_the_engines_reduction_on_the_others() -> None:
    """Inside the training loop rank 0's all_reduce meets rank 1's backward (DDP's gradient buckets) or,
    under fsdp, its forward (the lockstep before it): the fix is the branch's, not an evaluation's."""
    for kind, detail in (("backward", "the gradient all-reduce"), ("forward", "training mode")):
        states = {
            0: waiting(
                0, "all_reduce", 7, "train.py:72", sites={"all_reduce@train.py:72": 1, f"{kind}@train.py:36": 3}
            ),
            1: waiting(1, kind, 7, "train.py:36", detail=detail, sites={f"{kind}@train.py:36": 4}),
        }
        text = verdict.verdict(states)
        assert text.startswith("rank 0 is in all_reduce #7 (train.py:72) while rank 1 is in"), text
        assert "rank 0 ran code the others did not" in text, text
        assert verdict.FIX_BRANCH + verdict.IN_THE_LOOP in text and verdict.FIX_EVAL not in text, text
    # A branch whose other side is no engine's call keeps the fix as it was.
    states = {0: waiting(0, "all_reduce", 7, "train.py:72"), 1: waiting(1, "barrier", 7, "train.py:73")}
    assert verdict.IN_THE_LOOP not in verdict.verdict(states)


def test_verdict_an_engine_built_on_one_rank() -> None:
    """ZeRO-3's engine is built by the first call that needs it: a one-rank ``optimizer.state_dict()``
    before any training builds it on rank 0 alone while rank 1 is in its first forward."""
    states = {
        0: waiting(0, "engine build", 1, "train.py:10", detail="DeepSpeed's, a collective", sites={}),
        1: waiting(1, "forward", 1, "train.py:11", detail="training mode", sites={}),
    }
    text = verdict.verdict(states)
    assert text.startswith("rank 0 is in engine build #1 (train.py:10) while rank 1 is in"), text
    assert verdict.FIX_BUILD in text and verdict.FIX_EVAL not in text


def test_verdict_at_many_ranks_names_the_others_as_ranges() -> None:
    """A rehearsal at 16 ranks: rank 0 alone in a branch, the others in a barrier, and two of
    them not there at all; the verdict names them as ranges, not as 15 numbers."""
    states = {0: waiting(0, "all_reduce", 7, "train.py:50", sites={"all_reduce@train.py:50": 1})}
    states |= {r: waiting(r, "barrier", 7, "train.py:60") for r in range(1, 16) if r not in (9, 11)}
    states |= {r: waiting(r, "barrier", 7, "train.py:61") for r in (9, 11)}
    text = verdict.verdict(states)
    assert "rank 0 is in all_reduce #7 (train.py:50)" in text, text
    assert (
        "while ranks 1-8, 10, 12-15 are in barrier #7 (train.py:60) and ranks 9, 11 are in barrier #7 (train.py:61):"
        in text
    ), text
    assert verdict._ranks([3, 4]) == "ranks 3, 4" and verdict._ranks([2]) == "rank 2"
    assert verdict._ranks([5, 1, 2, 3, 7]) == "ranks 1-3, 5, 7"


def test_verdict_mismatched_shapes() -> None:
    states = {
        0: waiting(0, "all_reduce", 5, "train.py:45", shapes=[[3]], dtype="float32"),
        1: waiting(1, "all_reduce", 5, "train.py:45", shapes=[[5]], dtype="float32"),
    }
    text = verdict.verdict(states)
    assert text.startswith(
        "every rank is in all_reduce #5 (train.py:45) with different shapes: rank 0 passed [3] float32 but rank 1 "
        "passed [5] float32"
    ), text


def test_verdict_a_rank_raised_a_rank_sleeps_a_rank_is_gone() -> None:
    raised = {"rank": 1, "status": "raised", "error": "RuntimeError: boom", "error_where": "train.py:45"}
    text = verdict.verdict({0: waiting(0, "all_reduce", 3, "train.py:40"), 1: raised})
    assert text.startswith(
        "rank 1 raised RuntimeError at train.py:45 (boom) while rank 0 waits in all_reduce #3 (train.py:40) for 12 s"
    ), text
    sleeping = {
        "rank": 1,
        "status": "running",
        "now": "train.py:140",
        "text": "time.sleep(60)",
        "last": {"seq": 2, "kind": "backward", "where": "train.py:130"},
        "ago": 45.2,
    }
    text = verdict.verdict({0: waiting(0, "all_reduce", 3, "train.py:40"), 1: sleeping})
    assert text.startswith(
        "rank 1 never arrived: it is at train.py:140 `time.sleep(60)`, 45 s after its last collective backward #2 "
        "(train.py:130) while rank 0 waits in all_reduce #3 (train.py:40)"
    ), text
    assert verdict.verdict({0: waiting(0, "barrier", 3, "train.py:40"), 1: None}).startswith("rank 1 did not answer")
    same = verdict.verdict({0: waiting(0, "barrier", 3, "t.py:4"), 1: waiting(1, "barrier", 3, "t.py:4")})
    assert same.startswith("every rank is in barrier #3 (t.py:4) and has waited 12 s")


# ------------------------------------------------------------------ the exchange, two ranks as threads
class DictStore:
    """The store's four calls over a dict (the exchange's logic; the real TCP store is in the launcher test)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.d[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.d[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            if key not in self.d and expected == "":
                self.d[key] = desired.encode()
            return self.d[key]


def test_two_ranks_print_the_same_verdict_on_a_raise() -> None:
    store = DictStore()
    printed: dict[int, str] = {}
    waiting_rec, raising_rec = Recorder(), Recorder()
    f0 = exchange.Forensics(0, 2, store, 10.0, recorder=waiting_rec, out=lambda s: printed.__setitem__(0, s)).start()
    f1 = exchange.Forensics(1, 2, store, 10.0, recorder=raising_rec, out=lambda s: printed.__setitem__(1, s))
    with waiting_rec.call("all_reduce"):  # rank 0 waits while rank 1 raises
        try:
            raise RuntimeError("boom")
        except RuntimeError as exc:
            f1.report_failure(exc)
        deadline = time.monotonic() + 5
        while 0 not in printed and time.monotonic() < deadline:
            time.sleep(0.05)
    f0.close()
    assert printed[0].replace("rank 0)", "") == printed[1].replace("rank 1)", ""), printed
    assert "rank 1 raised RuntimeError at test_forensics.py:" in printed[1]
    assert "while rank 0 waits in all_reduce #1 (test_forensics.py:" in printed[1]


class SlowStore(DictStore):
    """A store whose every check takes a while, as a TCP store's does on a loaded machine."""

    def __init__(self) -> None:
        super().__init__()
        self.in_check = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.in_check.set()
        time.sleep(0.3)
        return super().check(keys)


def test_close_returns_after_the_thread_has_left_the_store() -> None:
    # A thread left inside a store call (C++ under a real store) when the interpreter finalises
    # aborts the process at exit (see Forensics.close).
    store = SlowStore()
    f = exchange.Forensics(1, 2, store, 10.0, recorder=Recorder()).start()
    assert store.in_check.wait(5)
    f.close()
    assert f._thread is not None and not f._thread.is_alive()


def test_a_parallelx_error_out_of_a_call_is_a_raise_not_a_wait() -> None:
    rec = Recorder()
    f = exchange.Forensics(0, 1, DictStore(), 10.0, recorder=rec)
    with pytest.raises(ParallelxError), rec.call("forward"):
        raise ParallelxError("fsdp: the ranks are at different forwards")
    assert f.state(rec.last().failed)["status"] == "raised"  # type: ignore[union-attr]
    with pytest.raises(RuntimeError), rec.call("all_reduce"):
        raise RuntimeError("Connection closed by peer")
    assert f.state(rec.last().failed)["status"] == "waiting"  # type: ignore[union-attr]


def test_the_alarm_after_part_of_the_timeout() -> None:
    assert exchange.alarm_after(20) == 12 and exchange.alarm_after(1800) == 1080
    assert record.split_what("the optimizer step (gradient synchronisation)") == (
        "the optimizer step",
        "gradient synchronisation",
    )


class HangingStore(DictStore):
    """A store whose host's cable is pulled: every operation blocks (a Python store has no
    timeout of its own, so only the report's own bound can end the wait)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = threading.Event()

    def _wait(self) -> None:
        if self.cut.is_set():
            threading.Event().wait(3600)

    def set(self, key: str, value: Any) -> None:
        self._wait()
        super().set(key, value)

    def check(self, keys: list[str]) -> bool:
        self._wait()
        return super().check(keys)


def test_a_store_that_stops_answering_does_not_hold_a_failing_rank() -> None:
    # The forensics thread raised the alarm first and hangs on the store holding the lock; the
    # main thread's error path still returns within twice the answer window.
    store, rec = HangingStore(), Recorder()
    f = exchange.Forensics(1, 2, store, 10.0, recorder=rec, out=lambda s: None).start()
    store.cut.set()
    threading.Thread(target=f.answer, kwargs={"alarm": True}, daemon=True).start()
    time.sleep(0.2)
    start = time.monotonic()
    f.report_failure(RuntimeError("Gloo timed out"))
    assert time.monotonic() - start < 2 * exchange.answer_window(10.0) + 2


def test_a_store_whose_host_is_gone_gives_this_ranks_verdict_within_the_window() -> None:
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))
    exchange._bound(client, 5.0)
    assert client.timeout.total_seconds() == exchange.answer_window(5.0)
    printed: list[str] = []
    rec = Recorder()
    f = exchange.Forensics(1, 2, dist.PrefixStore(exchange.PREFIX, client), 5.0, recorder=rec, out=printed.append)
    del server  # rank 0's host, and the store with it, are gone
    start = time.monotonic()
    with rec.call("all_reduce"):
        text = f.answer(alarm=True)
    assert time.monotonic() - start < 3 * exchange.answer_window(5.0)
    assert text is not None and printed == [f"parallelx: verdict (rank 1): {text}"]
    assert "rank 0 did not answer" in text and "rank 1 lost the store" in text, text
