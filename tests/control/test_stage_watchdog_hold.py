"""The stage watchdog and the agent's own waits on the coordinator.

While `up` is stopped (Ctrl-Z), the agent's step-report queue fills and the relay waits on it; the
worker, blocked writing its pipe, makes no progress the watchdog can see. That wait is the
agent's, not the worker's: a held watchdog never kills. Once released, a worker that still makes
no progress is killed as before. A real process (`sleep`, waiting, not busy) stands in for the
worker; the watchdog reads its state and CPU time from the kernel."""

from __future__ import annotations

import subprocess
import time

import pytest

from hetlaunch.runtime.stage_watchdog import StageWatchdog, WAITING_GRACE


@pytest.fixture
def waiting_worker():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.timeout(60)
def test_a_held_watchdog_kills_no_worker_and_a_released_one_still_does(waiting_worker):
    bound = 0.4
    watchdog = StageWatchdog(waiting_worker.pid, bound, bound)
    with watchdog.held():
        time.sleep(WAITING_GRACE * bound * 4)  # four times what kills an unwatched waiting worker
        assert waiting_worker.poll() is None and watchdog.stalled is None
    # released: the silence counts from here, and a worker that stays silent is killed
    deadline = time.monotonic() + 30
    while waiting_worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.stop()
    assert waiting_worker.poll() is not None, "a worker silent past the bound after the hold was not killed"
    assert watchdog.stalled is not None and "while its worker waited" in watchdog.stalled, watchdog.stalled


@pytest.mark.timeout(60)
def test_without_the_hold_the_same_wait_kills_the_worker(waiting_worker):
    """The control: the wait the hold covers above is long enough to kill a worker."""
    bound = 0.4
    watchdog = StageWatchdog(waiting_worker.pid, bound, bound)
    deadline = time.monotonic() + WAITING_GRACE * bound * 4 + 30
    while waiting_worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.stop()
    assert waiting_worker.poll() is not None and watchdog.stalled is not None
