"""On the CPU, where glibc's ``malloc`` serves the blocks that fsdp and ZeRO-3 gather and free every
step: a threshold that keeps set-up's long-lived blocks out of the heaps, then glibc's speed.

glibc's ``malloc`` serves a block above its mmap threshold with a mapping of its own, unmapped on
``free``; below it, from its heaps, which keep freed memory for the next allocation.  The threshold
starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB: through set-up and
the first step, the blocks that live for the whole run (the sharded parameters, ZeRO's gradient
partition, AdamW's state) then land in the heaps between short-lived ones, and the gaps stay in the
process's RSS (ZeRO-3, 2 processes, a 200 M-parameter GPT: 0.86 GiB through set-up and 3.3 GiB
after a step, against 0.55 and 2.0).  A fixed threshold of 1 MiB gives each of them a mapping of
its own, but kept for good it maps and page-faults every block above 1 MiB anew at every step
(fsdp's step 1.24x raw FSDP2's; 1.7-2.5x the page faults of a step).

So by default the threshold is 1 MiB from the join until the end of the first optimizer step (a
step post-hook, host-side, once), then fixed at 32 MiB, glibc's own ceiling, with a trim threshold
of 64 MiB: the later steps' blocks come from the heaps, as under glibc's own setting, around the
long-lived blocks held in mappings.  Measured (docs/big-models.md, "The allocator, both ways"): set-up
and after one step as with 1 MiB throughout, the page faults of a step within 10 % of glibc's own.
``PARALLELX_LOW_MEMORY=1`` keeps 1 MiB throughout (a lower peak over the later steps, for their
page faults).

GPU memory has torch's caching allocator instead; a process given another allocator (jemalloc,
tcmalloc through ``LD_PRELOAD``) or any ``MALLOC_*`` setting of its own is left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import torch

#: glibc's mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 20
#: After the first step: glibc's dynamic threshold's own ceiling, fixed, and a trim threshold above it.
STEADY_MMAP_THRESHOLD = 32 << 20
STEADY_TRIM_THRESHOLD = 64 << 20
#: The environment variable that asks for the low-memory setting.
LOW_MEMORY = "PARALLELX_LOW_MEMORY"

_mallopt: Any = None
_steady = False  # the first step's switch, once per process (several optimizers, several models)


def low_memory_asked() -> bool:
    return os.environ.get(LOW_MEMORY, "0").strip().lower() not in ("", "0", "false", "no", "off")


def _glibc_mallopt(device: torch.device) -> Any:
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return None
    if any(k.startswith("MALLOC_") for k in os.environ) or "LD_PRELOAD" in os.environ:
        return None  # the user chose
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_memory(device: torch.device) -> bool:
    """Fix glibc's mmap threshold at 1 MiB for a CPU process, through set-up and the first step (for
    good with ``PARALLELX_LOW_MEMORY=1``: the module's docstring); True when it was set."""
    global _mallopt, _steady
    mallopt = _glibc_mallopt(device)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, THRESHOLD):
        return False
    _steady = low_memory_asked()  # kept at 1 MiB throughout
    _mallopt = mallopt
    return True


def after_first_step(optimizer: torch.optim.Optimizer) -> None:
    """Raise the threshold once ``optimizer``'s first step has run (a host-side call, no collective)."""
    if _mallopt is None or _steady:
        return

    def switch(*_: Any) -> None:
        global _steady
        if not _steady:  # a flag: torch iterates the hooks while calling them, so no removal here
            _steady = True
            _mallopt(M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD)
            _mallopt(M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD)

    optimizer.register_step_post_hook(switch)
