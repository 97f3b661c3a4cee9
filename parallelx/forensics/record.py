"""Each rank's record of its collectives: a bounded ring buffer, cheap enough to leave on.

Every blocking call parallelx issues or wraps (the collectives, the backward and the
optimizer step that carry the engines' gradient reductions, a sharded model's forward,
``save``'s gathering) enters :func:`call`, which gives it this rank's next sequence number
and remembers its kind, its tensors' shapes and dtype, its process group and the user's
line that led to it: the first frame outside parallelx, torch, DeepSpeed, Horovod and
Python's own library.  The cost is a frame walk (cached per code object) and a few
attribute writes per call; the ring keeps the last :data:`KEEP` calls.

torch's Flight Recorder is not the engine: it records only what goes through a
``ProcessGroup`` (nothing of Horovod's controller or DeepSpeed's shared-memory
all-reduce), it records the transport's calls rather than the script's (a DDP bucket,
not the ``backward`` on line 288), and it is read by dumping every rank's buffer to
files after the fact, where a verdict must be printed while the job still runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import os
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from types import CodeType, FrameType
from typing import Any

from parallelx.errors import ParallelxError


class Parted(ParallelxError):
    """The ranks are at different collectives (found before the transport could pair them): the
    rank's state is the call it was in, for the verdict that names every rank's."""


#: How many finished calls each rank keeps.
KEEP = 64


@dataclasses.dataclass
class Call:
    """One recorded call."""

    seq: int
    kind: str
    where: str
    #: What the call does beyond its kind ("evaluation mode", "the gradient all-reduce").
    detail: str = ""
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = ""
    group: str = "world"
    started: float = 0.0
    ended: float | None = None
    #: The error that escaped the call (the transport's timeout, a closed connection).
    failed: BaseException | None = dataclasses.field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "kind": self.kind,
            "where": self.where,
            "detail": self.detail,
            "shapes": [list(s) for s in self.shapes],
            "dtype": self.dtype,
            "group": self.group,
        }


def _caller() -> FrameType | None:
    here = inspect.currentframe()
    return here.f_back.f_back if here is not None and here.f_back is not None else None


def _library_roots() -> tuple[str, ...]:
    roots = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # parallelx
    for name in ("torch", "deepspeed", "horovod", "parallelx.backends"):
        module = sys.modules.get(name)
        for path in getattr(module, "__path__", None) or ():
            roots.add(os.path.abspath(path))
    for key in ("stdlib", "platstdlib"):
        with contextlib.suppress(KeyError):
            roots.add(os.path.abspath(sysconfig.get_paths()[key]))
    return tuple(sorted(roots))


def _is_library(code: CodeType, cache: dict[CodeType, bool], roots: tuple[str, ...]) -> bool:
    known = cache.get(code)
    if known is None:
        name = code.co_filename
        known = (
            name.startswith("<")
            or any(name.startswith(r + os.sep) for r in roots)
            or f"{os.sep}site-packages{os.sep}" in name
        )
        cache[code] = known
    return known


class Recorder:
    """This process's record (one per process: it has one world)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.seq = 0
        self.done: deque[Call] = deque(maxlen=keep)
        #: The calls in flight, outermost first (nested: a broadcast inside ``save``).
        self.open: list[Call] = []
        #: How often each (kind, line) was entered: which code each rank has run.
        self.sites: dict[str, int] = {}
        self.main_ident = threading.main_thread().ident
        self._roots: tuple[str, ...] | None = None
        self._cache: dict[CodeType, bool] = {}

    # ------------------------------------------------------------------ frames
    def user_frame(self, frame: FrameType | None) -> FrameType | None:
        """The first frame at or above ``frame`` outside the libraries."""
        if self._roots is None:
            self._roots = _library_roots()
        roots, cache = self._roots, self._cache
        while frame is not None and _is_library(frame.f_code, cache, roots):
            frame = frame.f_back
        return frame

    def user_line(self, frame: FrameType | None = None) -> str:
        """``train.py:288``: where the user's script stands (the caller's stack by default)."""
        found = self.user_frame(frame if frame is not None else _caller())
        if found is None:
            return "?"
        return f"{os.path.basename(found.f_code.co_filename)}:{found.f_lineno}"

    def main_line(self) -> tuple[str, str]:
        """The main thread's user line now and its source text (read from another thread)."""
        frame = sys._current_frames().get(self.main_ident or -1)
        found = self.user_frame(frame)
        if found is None:
            return "?", ""
        text = linecache.getline(found.f_code.co_filename, found.f_lineno).strip()
        return f"{os.path.basename(found.f_code.co_filename)}:{found.f_lineno}", text

    # ------------------------------------------------------------------- calls
    @contextlib.contextmanager
    def call(self, kind: str, detail: str = "", group: str = "world") -> Iterator[Call]:
        """Record the block as one call (nested calls get their own numbers)."""
        self.seq += 1
        where = self.user_line(_caller())
        entry = Call(self.seq, kind, where, detail, group=group, started=time.monotonic())
        site = f"{kind}@{where}"
        self.sites[site] = self.sites.get(site, 0) + 1
        self.open.append(entry)
        try:
            yield entry
        except BaseException as exc:
            entry.failed = exc
            raise
        finally:
            entry.ended = time.monotonic()
            # Ends in order, except on an error escaping several levels at once.
            if self.open and self.open[-1] is entry:
                self.open.pop()
            elif entry in self.open:
                self.open.remove(entry)
            self.done.append(entry)

    def describe(self, tensors: Iterable[Any]) -> None:
        """Shapes and dtype of the innermost call in flight."""
        if not self.open:
            return
        shapes = []
        dtype = ""
        for t in tensors:
            shape = getattr(t, "shape", None)
            if shape is not None:
                shapes.append(tuple(int(n) for n in shape))
                dtype = dtype or str(getattr(t, "dtype", "")).replace("torch.", "")
        entry = self.open[-1]
        entry.shapes, entry.dtype = tuple(shapes), dtype

    def current(self) -> Call | None:
        """The innermost call in flight (None between calls)."""
        return self.open[-1] if self.open else None

    def oldest_open(self) -> Call | None:
        return self.open[0] if self.open else None

    def last(self) -> Call | None:
        return self.done[-1] if self.done else None

    def history(self) -> list[Call]:
        return list(self.done)


#: The one record of this process.
RECORDER = Recorder()


def call(kind: str, detail: str = "", group: str = "world") -> contextlib.AbstractContextManager[Call]:
    """``with record.call("broadcast"): ...`` on :data:`RECORDER`."""
    return RECORDER.call(kind, detail, group)


def describe(*tensors: Any) -> None:
    RECORDER.describe(tensors)


@contextlib.contextmanager
def watched(what: str, guard: contextlib.AbstractContextManager[Any]) -> Iterator[Call]:
    """A watched call (``"backward (the gradient all-reduce)"``) recorded, inside ``guard`` (a watchdog)."""
    kind, detail = split_what(what)
    with RECORDER.call(kind, detail) as entry, guard:
        yield entry


def split_what(what: str) -> tuple[str, str]:
    """A watched call's name (``"backward (the gradient all-reduce)"``) as kind and detail."""
    kind, _, rest = what.partition(" (")
    return kind, rest[:-1] if rest.endswith(")") else rest
