"""`up` stopped a while (Ctrl-Z, SIGSTOP) and continued: the job goes on. Its agents left after
10 s without an answered heartbeat, and on waking the coordinator found every node silent past
the timeout, so a 13 s pause ended a healthy run as "lost nodes n0, n1, n2" (a hostile review).
Agents now wait while the `up` that started them is stopped, and the coordinator measures
silence on a clock that leaves out the time it did not run (launcher/pause_clock.py). A report
that times out (30 s) is sent again: sent once, a 40 s pause lost the 19 steps in flight and the
run ended "stages finished but only 281 of 300 steps reported"."""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import REPO, output, popen_hetlaunch, stop_process, wait_for
from hetlaunch.launcher.pause_clock import PauseClock


def test_the_clock_leaves_out_a_gap_longer_than_a_pause_and_keeps_short_ones():
    now = [100.0]
    clock = PauseClock(tick_s=0.25, gap_s=2.0, monotonic=lambda: now[0], ticking=False)
    assert clock.now() == 100.0
    now[0] = 101.5  # late, not a pause
    assert clock.now() == 101.5
    now[0] = 114.5  # 13 s without a tick: stopped
    assert clock.now() == pytest.approx(114.5 - 12.75) and clock.paused_s == pytest.approx(12.75)
    now[0] = 115.0
    assert clock.now() == pytest.approx(115.0 - 12.75)


@pytest.mark.timeout(300)
def test_up_stopped_for_longer_than_any_timeout_goes_on_when_continued(tmp_path):
    # rebalance off: a straggler restart beside a busy machine is no loss the pause caused (it failed so once)
    cluster = (REPO / "cluster_examples" / "tiny_test.yaml").read_text().replace(
        "  steps: 20\n", "  steps: 300\n  rebalance: off\n", 1)
    assert "steps: 300\n  rebalance: off" in cluster
    (tmp_path / "c.yaml").write_text(cluster)
    run = tmp_path / "run"
    proc = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run))
    try:
        def steps() -> int:
            path = run / "metrics.jsonl"
            return len(path.read_text().splitlines()) if path.exists() else 0
        wait_for(lambda: steps() >= 20, 150, "step 20", proc)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(36)  # past the agents' 10 s, the 4 s heartbeat timeout and a report's 30 s
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=150)
    finally:
        out, err = stop_process(proc)
    assert proc.returncode == 0, err + out
    assert steps() == 300
    events = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "lost" not in events and "restart" not in events, events
    # the reports in flight timed out and were sent again (else this run did not test that)
    logs = "".join(path.read_text() for path in (run / "logs").glob("*.log"))
    assert "ReportStep not answered (DEADLINE_EXCEEDED): sending it again" in logs
