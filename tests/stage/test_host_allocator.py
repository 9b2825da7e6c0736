"""The worker's glibc malloc settings (runtime/host_allocator.py; HETLAUNCH_HOST_MALLOC chooses, kept
by default): a step's freed memory is kept for the next step instead of being faulted in again.

The probe allocates and frees 4 MB tensors 300 times, in the main thread and in a second thread
(the worker's pipe and report threads can push the training thread onto a secondary arena).
Re-faulting each time would cost 2,048 minor faults per iteration (600,000 in all); with the
settings the count stays what the first few iterations take. With glibc's defaults it was
anywhere from 2,048 to 604,800 here, so the defaults are not asserted on.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from hetlaunch.runtime.host_allocator import CHOICE

pytestmark = [pytest.mark.quick,
              pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="the settings are glibc's")]

PROBE = """
import resource, sys, threading
import torch
from hetlaunch.runtime.host_allocator import tune_host_allocator
print(tune_host_allocator())
torch.set_num_threads(1)
def work(out):
    for _ in range(3):
        x = torch.ones(1 << 20); y = x * 2; del x, y
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(300):
        x = torch.ones(1 << 20); y = x * 2; del x, y
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
if sys.argv[1] == "thread":
    t = threading.Thread(target=work, args=(out,)); t.start(); t.join()
else:
    work(out)
print(out[0])
"""


def _probe(where: str, env: dict) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE, where], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    said, faults = done.stdout.strip().splitlines()
    return said, int(faults)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("choice", ["", "one-arena"])  # "": what a worker does unless told otherwise
def test_freed_tensors_are_not_faulted_in_again(where, choice):
    said, faults = _probe(where, {CHOICE: choice})
    assert said == ("glibc malloc: one arena, " if choice else "glibc malloc: ") + "freed memory kept for the next step"
    assert faults < 20_000, faults  # refaulting every iteration would be ~600,000


@pytest.mark.timeout(120)
def test_asked_for_glibc_keeps_its_defaults():
    said, _ = _probe("main", {CHOICE: "default"})
    assert said == "glibc malloc defaults kept"


@pytest.mark.timeout(120)
def test_a_misspelt_choice_says_so_and_changes_nothing():
    said, _ = _probe("main", {CHOICE: "fast"})
    assert said == f"{CHOICE}='fast' is not one of kept, one-arena, default: host allocator left as it is"
