"""glibc's malloc, set for a training loop: keep the memory a step frees for the next step.

A stage allocates and frees the same tensors every step. glibc's defaults hand big freed blocks
back to the kernel (each block over the mmap threshold is its own mapping; a heap's free top
over the trim threshold is trimmed), so the next step faults the same pages in again, zeroed.
Worse, a thread whose arena is busy the moment it allocates moves to another arena (the worker's
pipe and report threads allocate too), and secondary arenas shrink their heaps on free.

Measured on the overhead bench's stage (one CPU stage, 0.9M parameters, 2026-12-04): 4,250
minor page faults and 19 ms of system time per step with the defaults; 919 and 6 ms with one
arena; 3 and 3 ms with one arena and the thresholds below. A plain PyTorch loop in one thread
takes 2,005 and 7 ms. The worker serves blocks up to MMAP_THRESHOLD_BYTES from the heap and
keeps up to TRIM_THRESHOLD_BYTES of freed heap (the CUDA caching allocator does the same for
device memory). Resident memory stays at a step's peak instead of dipping between steps.

On by default since 2026-12-04 (it was opt-in, one arena with it). Found
in the zero-bubble bench: a ZB-H1 stage's compute thread took 4,000-4,600 minor faults and
30-65 ms of system time in some pieces (a 20 ms piece ran 70-110 ms of CPU), at random steps,
because a split backward holds a varying number of graphs and the heap's top kept being trimmed
and faulted in again; under `emulate: speed: 0.1` each such piece cost ten times that, and the
ZB steps ran 1.2-1.3x their prediction. With the thresholds, past the first three steps no piece
faulted: a traced run's steps were 0.97-1.08x the prediction, and `python bench/run.py zero_bubble`
measured ZB-H1 1.35x 1F1B (1.01x before).
HETLAUNCH_HOST_MALLOC in the agent's environment chooses: `kept` (the default), `one-arena`
(also a single arena: fewer faults still where other threads allocate, 3 against 919 a step on
the overhead bench's stage, but `vs_torch_pipelining` measured 0.895, 0.975, 0.905 with it
against 1.014 without, one run beside it; `tuned` is its older name) or `default` (glibc's own).
Only where the C library is glibc (Linux).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 1 << 30
CHOICE = "HETLAUNCH_HOST_MALLOC"
CHOICES = {"": "kept", "kept": "kept", "one-arena": "one-arena", "tuned": "one-arena", "default": "default"}


def tune_host_allocator() -> str:
    """Set glibc's malloc for a training loop; what was done, in words (for the worker's log)."""
    asked = os.environ.get(CHOICE, "")
    choice = CHOICES.get(asked)
    if choice is None:
        return f"{CHOICE}={asked!r} is not one of kept, one-arena, default: host allocator left as it is"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc: host allocator left as it is"
    if choice == "default":
        return "glibc malloc defaults kept"
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as err:
        return f"libc.so.6 not loadable ({err}): host allocator left as it is"
    settings = [("M_MMAP_THRESHOLD", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                ("M_TRIM_THRESHOLD", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)]
    if choice == "one-arena":
        settings.insert(0, ("M_ARENA_MAX", M_ARENA_MAX, 1))
    refused = [name for name, option, value in settings if libc.mallopt(option, value) != 1]
    if refused:
        return f"glibc malloc: mallopt refused {', '.join(refused)}"
    return ("glibc malloc: one arena, " if choice == "one-arena" else "glibc malloc: ") + \
        "freed memory kept for the next step"
