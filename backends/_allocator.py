"""On the CPU, freed blocks go back to the system: for the backends that gather and free parameters
every step (fsdp, ZeRO-3).

glibc's ``malloc`` serves a block above its mmap threshold with a mapping of its own, unmapped on
``free``; below it, from its heaps, which keep freed memory.  The threshold starts at 128 KiB and
rises to the size of each mapped block freed, up to 32 MiB: after the first step, a gathered unit's
weights and gradients (4-32 MiB each for a 200 M-parameter GPT) come from the heaps, and the gaps
between them stay in the process's RSS.  Measured on ZeRO-3, 2 processes, a 202 M-parameter GPT:
0.9 GiB of a rank's 4.3 GiB peak.  A fixed threshold of 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, what
``MALLOC_MMAP_THRESHOLD_=1048576`` sets) keeps every block of that size a mapping of its own.  GPU
memory has torch's caching allocator instead; a process given another allocator (jemalloc,
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


def return_freed_memory(device: torch.device) -> bool:
    """Fix glibc's mmap threshold at 1 MiB for a CPU process; True when it was set."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "LD_PRELOAD" in os.environ:
        return False  # the user chose
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
