"""An emulated speed holds under load: a speed-0.5 node takes twice as long as the same node at speed 1.

In-process, no agents: a fixed single-threaded CPU workload is run at speed 1.0 and at 0.5, piece after
piece, while the machine is kept busy by one CPU-burning process per core. Each pair of pieces runs back
to back, so both see the same load; the order alternates, so a drift in load favours neither side.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from hetlaunch.runtime import emulation
from hetlaunch.runtime.emulation import ComputeEmulation

CPU = torch.device("cpu")
BURN_S = 60  # a burner ends by itself after this, even if the test process is killed before its finally


def _workload(x: torch.Tensor, w: torch.Tensor) -> None:
    # About 25 ms on one core here: several scheduling slices, so a busy machine slows every piece
    # about alike instead of preempting some pieces wholesale and sparing others. (Pieces of one
    # slice or less fall short of the ratio on an oversubscribed machine: see ComputeEmulation.stretch.)
    for _ in range(150):
        x = torch.tanh(x @ w)


def _timed(emulation: ComputeEmulation, x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    mark = emulation.start()
    _workload(x, w)
    emulation.stretch(mark, CPU)
    return time.perf_counter() - start


def _ratios(speed: float, pairs: int = 21) -> list[float]:
    """Seconds at `speed` over seconds at 1.0 for the same piece of work, pair by pair."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator)
    w = torch.randn(256, 256, generator=generator) / 16
    full, slowed = ComputeEmulation(1.0), ComputeEmulation(speed)
    for _ in range(3):
        _workload(x, w)
    ratios = []
    for k in range(pairs):
        if k % 2:
            slow = _timed(slowed, x, w)
            fast = _timed(full, x, w)
        else:
            fast = _timed(full, x, w)
            slow = _timed(slowed, x, w)
        ratios.append(slow / fast)
    return ratios


@pytest.fixture
def one_thread():
    # A one-thread CPU stage: the case where the emulation used to stretch CPU time, not wall time.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def busy_machine():
    """One `while True: pass` per core, for the test's duration; killed afterwards, whatever happens."""
    burn = f"import time\nend = time.monotonic() + {BURN_S}\nwhile time.monotonic() < end: pass"
    burners = []
    try:
        for _ in range(os.cpu_count() or 1):
            burners.append(subprocess.Popen([sys.executable, "-c", burn]))
        time.sleep(0.3)  # let them get going
        yield
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait(timeout=10)


@pytest.mark.timeout(60)
def test_half_speed_takes_twice_as_long_on_an_idle_machine(one_thread):
    ratios = _ratios(0.5)
    assert 1.6 <= statistics.median(ratios) <= 2.6, ratios


@pytest.mark.timeout(60)
def test_half_speed_takes_twice_as_long_on_a_busy_machine(one_thread, busy_machine):
    # Every core is busy, so the workload's wall time is well above its CPU time. Stretching only up
    # to CPU time / speed, as the emulation once did, adds (almost) nothing here: the ratio fell to ~1.
    ratios = _ratios(0.5)
    assert 1.6 <= statistics.median(ratios) <= 2.6, ratios


class _Clock:
    """runtime/emulation.py's `time` for a test: a wall clock that moves only when the test waits
    (`wait`) or the emulation sleeps (recorded), so what is stretched is checked to the bit
    instead of against a loaded machine's timing."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def perf_counter(self) -> float:
        return self.now

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(emulation, "time", clock)
    return clock


def test_wall_time_spent_waiting_inside_the_compute_is_stretched_too(clock):
    # Work that waits (CUDA kernels, a thread pool, a busy core) is stretched by its wall time:
    # speed 0.25 makes 20 ms of waiting last 80 ms.
    compute = ComputeEmulation(0.25)
    mark = compute.start()
    clock.wait(0.02)
    compute.stretch(mark, CPU)
    assert clock.sleeps == [pytest.approx(0.06, abs=1e-12)]
    assert clock.now - mark == pytest.approx(0.08, abs=1e-12)


def test_full_speed_adds_nothing(clock):
    compute = ComputeEmulation(1.0)
    mark = compute.start()
    clock.wait(0.02)
    compute.stretch(mark, CPU)
    assert clock.sleeps == [] and clock.now - mark == pytest.approx(0.02, abs=1e-12)


def test_cuda_kernels_are_waited_for_before_the_work_is_measured(monkeypatch, clock):
    # No GPU needed: stand in for a CUDA stream whose queued kernels take 20 ms to finish.
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (synced.append(device), clock.wait(0.02)))
    compute = ComputeEmulation(0.5)
    mark = compute.start()
    compute.stretch(mark, torch.device("cuda", 0))
    assert synced == [torch.device("cuda", 0)]
    assert clock.sleeps == [pytest.approx(0.02, abs=1e-12)]  # the kernels' 20 ms, stretched to 40 ms
    compute.stretch(compute.start(), CPU)
    assert len(synced) == 1, "a CPU stage never synchronises CUDA"
