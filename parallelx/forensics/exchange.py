"""On a timeout or a rank's error: every rank's record over a store, one verdict on every rank.

Each rank runs a small thread that looks at two things twice a second: whether its own
oldest call in flight has waited longer than :func:`alarm_after` (a fraction of the
collective timeout, so the verdict comes *before* the transport's own error, which
follows), and whether another rank has raised the alarm in the store.  Either way the
rank publishes its state (the call it is in, or, outside any call, the line its main
thread is at and its last call; or the exception it raised), waits a few seconds for
the others', and prints the verdict of :func:`parallelx.forensics.verdict.verdict`.  The
first verdict written to the store is the one every rank prints, so all print the same
words.  A rank that raises publishes from :func:`report_failure` (the facade's error
path) and waits for the others to have printed before its process ends.

The store does not depend on the stuck group: it is the rendezvous's TCP store (a
connection of its own, cloned from ``torch.distributed``'s default store) for the
``torch.distributed`` backends, and a TCP store that rank 0 serves for Horovod (its
address handed round once, at set-up, through the backend's own broadcast).

The store can be gone too (its host's cable pulled, its process dead): every operation on
it is bounded by the answer window, the first that fails ends the exchange on this rank,
which then prints the verdict over what it has (itself alone: the others "did not
answer"), and a failing rank never waits on the exchange longer than twice the window.
"""

from __future__ import annotations

import datetime as _dt
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from parallelx.errors import ParallelxError
from parallelx.forensics import verdict as _verdict
from parallelx.forensics.record import RECORDER, Parted, Recorder

#: Where every key lives in the store.
PREFIX = "parallelx/forensics"
#: ``$PARALLELX_DUMP_STACKS``: a folder where each rank writes its Python stack at the verdict.
STACKS_ENV = "PARALLELX_DUMP_STACKS"
#: ``$PARALLELX_FORENSICS=0`` turns the exchange off (the record stays).
ENABLE_ENV = "PARALLELX_FORENSICS"


def alarm_after(timeout_s: float) -> float:
    """How long a call may wait before the ranks compare notes: early enough that the verdict
    comes before the transport gives up at ``timeout_s``."""
    return max(1.0, 0.6 * timeout_s)


def answer_window(timeout_s: float) -> float:
    """How long a rank waits for the others' states."""
    return max(2.0, min(10.0, 0.2 * timeout_s))


class Forensics:
    """This rank's side of the exchange."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Any,
        timeout_s: float,
        *,
        stacks_dir: str | os.PathLike[str] | None = None,
        recorder: Recorder = RECORDER,
        out: Callable[[str], None] | None = None,
        keep: Any = None,
    ) -> None:
        self.rank, self.world_size, self.store = rank, world_size, store
        self.timeout_s = timeout_s
        self.stacks_dir = Path(stacks_dir) if stacks_dir else None
        self.recorder = recorder
        self.out = out or _stderr
        #: The verdict printed here (None: none yet).
        self.printed: str | None = None
        self._keep = keep  # a store server this rank serves (Horovod's), kept alive
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ thread
    def start(self) -> Forensics:
        self._thread = threading.Thread(target=self._run, name="parallelx-forensics", daemon=True)
        self._thread.start()
        return self

    def close(self, wait_s: float | None = None) -> None:
        """Stop the thread and wait for it: at most ``wait_s``, by default the answer window (the
        bound of a store call).  A second close waits for nothing.

        Not waiting once killed processes at exit: a daemon thread still inside a store call
        (C++, the GIL released) when the interpreter finalises is ended by Python as it takes
        the GIL back, and the unwinding crosses a C++ destructor, which aborts the process
        ("terminate called without an active exception", exit 134) after its work was done."""
        if self._stop.is_set():
            return
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(answer_window(self.timeout_s) + 1.0 if wait_s is None else max(0.0, wait_s))

    def _run(self) -> None:
        limit = alarm_after(self.timeout_s)
        while not self._stop.wait(0.5):
            try:
                if self.printed is not None:
                    return
                oldest = self.recorder.oldest_open()
                if oldest is not None and time.monotonic() - oldest.started > limit:
                    self.answer(alarm=True)
                elif self.store.check([f"{PREFIX}/alarm"]):
                    self.answer(alarm=False)
            except Exception:  # the store is gone before anyone raised the alarm: nothing to say yet
                return

    # ------------------------------------------------------------------ answer
    def state(self, error: BaseException | None = None) -> dict[str, Any]:
        """What this rank is doing now, for the others."""
        rec, now = self.recorder, time.monotonic()
        current, oldest, last = rec.current(), rec.oldest_open(), rec.last()
        failed_call = None
        if error is not None and last is not None:
            # An error out of a recorded call: the transport's (this rank was waiting in it), or
            # parallelx's own about that call (it raised there).
            chain: BaseException | None = error
            while chain is not None and failed_call is None:
                failed_call = last if last.failed is chain else None
                chain = chain.__cause__ or chain.__context__
        raised_in = None
        if failed_call is not None and isinstance(error, ParallelxError) and not isinstance(error, Parted):
            raised_in, failed_call = failed_call, None
        out: dict[str, Any] = {"rank": self.rank, "sites": dict(rec.sites)}
        if error is not None and failed_call is None and current is None:
            tb = error.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = "?"
            if tb is not None:
                # The innermost of the user's frames in the traceback.
                frames = []
                t = error.__traceback__
                while t is not None:
                    frames.append(t)
                    t = t.tb_next
                for t in reversed(frames):
                    if rec.user_frame(t.tb_frame) is t.tb_frame:
                        where = f"{os.path.basename(t.tb_frame.f_code.co_filename)}:{t.tb_lineno}"
                        break
            out.update(status="raised", error=f"{type(error).__name__}: {error}".splitlines()[0], error_where=where)
            if raised_in is not None:
                out.update(call=raised_in.as_dict(), error_where=raised_in.where)
        elif current is not None or failed_call is not None:
            call = current if current is not None else failed_call
            assert call is not None
            out.update(
                status="waiting",
                call=call.as_dict(),
                outer=(oldest or call).as_dict(),
                waited=now - (oldest or call).started,
            )
        else:
            line, text = rec.main_line()
            out.update(status="running", now=line, text=text[:80])
            if last is not None:
                out.update(last=last.as_dict(), ago=now - (last.ended or now))
        return out

    def answer(self, *, alarm: bool, error: BaseException | None = None) -> str | None:
        """Publish this rank's state, gather the others', print the verdict (once).  If the
        store stops answering, the verdict is over what this rank has (see the module)."""
        with self._lock:
            if self.printed is not None:
                return self.printed
            mine = self.state(error)
            if self.stacks_dir is not None:
                mine["stacks"] = self._dump_stacks()
            states: dict[int, Any] = dict.fromkeys(range(self.world_size))
            states[self.rank] = mine
            unreachable = None
            try:
                text = self._exchange(mine, states, alarm=alarm or error is not None)
            except Exception as e:  # a store operation ran past the window or its peer is gone
                unreachable = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                text = self._verdict(states)
                text += f" [rank {self.rank} lost the store the ranks compare notes in: {unreachable}]"
            self.printed = text
            self.out(f"parallelx: verdict (rank {self.rank}): {text}")
            if unreachable is None:
                try:
                    self.store.set(f"{PREFIX}/printed/{self.rank}", "1")
                except Exception:
                    pass
            return text

    def _exchange(self, mine: dict[str, Any], states: dict[int, Any], *, alarm: bool) -> str:
        store = self.store
        store.set(f"{PREFIX}/state/{self.rank}", json.dumps(mine))
        if alarm:
            store.set(f"{PREFIX}/alarm", str(self.rank))
        keys = [f"{PREFIX}/state/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + answer_window(self.timeout_s)
        while time.monotonic() < deadline and not store.check(keys):
            time.sleep(0.1)
        for r, key in enumerate(keys):
            if r != self.rank and store.check([key]):
                states[r] = json.loads(store.get(key))
        # The first verdict written is the one every rank prints.
        return bytes(store.compare_set(f"{PREFIX}/verdict", "", self._verdict(states))).decode()

    def _verdict(self, states: dict[int, Any]) -> str:
        """The verdict over ``states``, naming where the stacks went when they were asked for."""
        text = _verdict.verdict(states)
        if self.stacks_dir is not None:
            text += f" (each rank's Python stack: {self.stacks_dir}{os.sep}rank-<N>.txt)"
        return text

    def report_failure(self, error: BaseException) -> None:
        """This rank raised (or its call failed): tell the others, wait until they have printed.
        Bounded: the exchange runs on a thread of its own, and this returns after twice the
        answer window whatever the store does (the error itself then ends the process)."""
        if self._stop.is_set():
            return
        window = answer_window(self.timeout_s)

        def tell() -> None:
            try:
                self.answer(alarm=True, error=error)
                keys = [f"{PREFIX}/printed/{r}" for r in range(self.world_size)]
                deadline = time.monotonic() + window
                while time.monotonic() < deadline and not self.store.check(keys):
                    time.sleep(0.1)
            except Exception:  # the store went with a failed peer: the error itself is reported as before
                pass

        deadline = time.monotonic() + 2 * window + 1.0
        teller = threading.Thread(target=tell, name="parallelx-forensics-report", daemon=True)
        teller.start()
        teller.join(deadline - time.monotonic())
        self.close(wait_s=deadline - time.monotonic())

    def _dump_stacks(self) -> str:
        assert self.stacks_dir is not None
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        path = self.stacks_dir / f"rank-{self.rank}.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        return str(path)


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


#: This process's exchange, once a world of more than one process is joined.
ACTIVE: Forensics | None = None


def _bound(store: Any, timeout_s: float) -> None:
    """Every operation on ``store`` gives up after the answer window (see the module)."""
    try:
        store.set_timeout(_dt.timedelta(seconds=answer_window(timeout_s)))
    except Exception:  # a store without timeouts of its own: the report's join still bounds it
        pass


def torch_store(timeout_s: float) -> Any:
    """A connection of its own to ``torch.distributed``'s rendezvous store, or None."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    try:
        store = store.clone()  # a connection the main thread never blocks
    except Exception:
        pass  # shared with the job's own calls: left unbounded (the report's join bounds it)
    else:
        _bound(store, timeout_s)
    return dist.PrefixStore(PREFIX, store)


def own_store(rank: int, broadcast: Callable[[Any], Any], timeout_s: float) -> tuple[Any, Any]:
    """A TCP store that rank 0 serves, for a backend without ``torch.distributed`` (Horovod).
    Every rank calls it (one broadcast of the address)."""
    timeout = _dt.timedelta(seconds=max(30.0, timeout_s))
    server = None
    # The same type on every rank: Horovod names a broadcast of an object after its type.
    where: tuple[str, int] = ("", 0)
    if rank == 0:
        server = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timeout, wait_for_workers=False)
        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        try:
            addr = "127.0.0.1" if host in ("localhost", "127.0.0.1") else socket.gethostbyname(host)
        except OSError:
            addr = "127.0.0.1"
        where = (addr, int(server.port))
    where = broadcast(where)
    client = dist.TCPStore(where[0], where[1], None, False, timeout=timeout)
    _bound(client, timeout_s)
    return dist.PrefixStore(PREFIX, client), server


def start(
    rank: int,
    world_size: int,
    timeout_s: float,
    broadcast: Callable[[Any], Any],
    *,
    stacks_dir: str | os.PathLike[str] | None = None,
) -> Forensics | None:
    """Start this rank's exchange (every rank calls it at set-up); None in a world of one process."""
    global ACTIVE
    if world_size <= 1 or os.environ.get(ENABLE_ENV, "1") == "0":
        ACTIVE = None
        return None
    store, server = torch_store(timeout_s), None
    if store is None:
        store, server = own_store(rank, broadcast, timeout_s)
    stacks = stacks_dir or os.environ.get(STACKS_ENV) or None
    ACTIVE = Forensics(rank, world_size, store, timeout_s, stacks_dir=stacks, keep=server).start()
    return ACTIVE


def report_failure(error: BaseException | None) -> None:
    """The facade's error path: this rank raised ``error``."""
    if ACTIVE is not None and error is not None and not isinstance(error, (SystemExit, KeyboardInterrupt)):
        ACTIVE.report_failure(error)


def stop() -> None:
    global ACTIVE
    if ACTIVE is not None:
        ACTIVE.close()
        ACTIVE = None
