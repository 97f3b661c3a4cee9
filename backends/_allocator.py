"""On the CPU, freed blocks can go back to the system at once: the low-memory setting for the
backends that gather and free parameters every step (fsdp, ZeRO-3), an explicit choice.

glibc's ``malloc`` serves a block above its mmap threshold with a mapping of its own, unmapped on
``free``; below it, from its heaps, which keep freed memory for the next allocation.  The threshold
starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB: after the first
step, a gathered unit's weights and gradients (4-32 MiB each for a 200 M-parameter GPT) come from
the heaps, and the gaps between them stay in the process's RSS.  A fixed threshold of 1 MiB
(``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_=1048576`` sets) makes every such block
a mapping of its own, unmapped when freed: a lower peak RSS, but every block above 1 MiB is then
mapped and page-faulted anew at every step.  Measured (docs/benchmarks.md, "The step's collectives
and the allocator"): fsdp's step 1.24x raw FSDP2's with it, 1.01-1.02x without.  So it is never the
default: ``PARALLELX_LOW_MEMORY=1`` (or glibc's own ``MALLOC_MMAP_THRESHOLD_``) asks for it.

GPU memory has torch's caching allocator instead; a process given another allocator (jemalloc,
tcmalloc through ``LD_PRELOAD``) or its own threshold is left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch

#: glibc's mallopt parameter number (malloc.h).
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 20
#: The environment variable that asks for the low-memory setting.
LOW_MEMORY = "PARALLELX_LOW_MEMORY"


def low_memory_asked() -> bool:
    return os.environ.get(LOW_MEMORY, "0").strip().lower() not in ("", "0", "false", "no", "off")


def return_freed_memory(device: torch.device) -> bool:
    """Fix glibc's mmap threshold at 1 MiB for a CPU process when ``PARALLELX_LOW_MEMORY=1`` asks for
    it (it costs step time: the module's docstring); True when it was set."""
    if not low_memory_asked() or device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "LD_PRELOAD" in os.environ:
        return False  # the user chose
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
