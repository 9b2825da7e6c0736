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
import subprocess
import time

import pytest

from conftest import REPO, hetlaunch_cmd, hetlaunch_env, popen_hetlaunch, stop_process, wait_for
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
    assert "ReportStep not answered (DEADLINE_EXCEEDED): sending it again until it is" in logs


REMOTE_CLUSTER = """
name: pause-remote
model: {preset: tiny, n_layers: 2, seq_len: 32, d_model: 32}
coordinator: {host: 127.0.0.1, join_timeout_s: 60, heartbeat_timeout_s: 4}
train: {steps: 300, micro_batch_size: 4, num_microbatches: 4, rebalance: off}
nodes:
  - {name: r0, launch: remote, host: box-0, device: cpu}
  - {name: r1, launch: remote, host: box-1, device: cpu}
"""


def _remote_job(tmp_path) -> tuple[subprocess.Popen, list[subprocess.Popen], object]:
    """`up` of two remote agents started by hand (not its children), at step 20 of 300."""
    token = tmp_path / "token"
    token.write_text("pause-token\n")
    token.chmod(0o600)
    (tmp_path / "c.yaml").write_text(REMOTE_CLUSTER)
    run = tmp_path / "run"
    env = hetlaunch_env()
    env.pop("HETLAUNCH_TOKEN", None)
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run), "--token-file", str(token), env=env)
    agents = []
    try:
        contact = run / "coordinator.json"
        wait_for(contact.exists, 30, "coordinator.json", proc=up)
        address = wait_for(lambda: json.loads(contact.read_text() or "{}").get("address"), 10, "the address", proc=up)
        for name in ("r0", "r1"):
            agents.append(subprocess.Popen(
                hetlaunch_cmd("agent", "--coordinator", address, "--token-file", str(token), "--name", name),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=hetlaunch_env(OMP_NUM_THREADS="1"), cwd=tmp_path))
        wait_for(lambda: _steps(run) >= 20, 150, "step 20", up)
    except BaseException:
        _end(up, agents)
        raise
    return up, agents, run


def _steps(run) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _end(up: subprocess.Popen, agents: list[subprocess.Popen]) -> tuple[str, str]:
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
            agent.communicate(timeout=10)
    return stop_process(up)


@pytest.mark.timeout(300)
def test_agents_on_other_hosts_wait_out_a_stopped_up(tmp_path):
    """Agents `up` did not start cannot see it stopped: they left after 10 s without an answered
    heartbeat and the job ended. They now wait while its port still takes connections (the kernel
    completes them for a stopped process); one that is gone refuses them (the test below)."""
    up, agents, run = _remote_job(tmp_path)
    try:
        up.send_signal(signal.SIGSTOP)
        time.sleep(16)  # past the agents' 10 s without an answered heartbeat
        alive = [agent.poll() is None for agent in agents]
        up.send_signal(signal.SIGCONT)
        up.wait(timeout=150)
        logs = [agent.communicate(timeout=60)[0] for agent in agents]
    finally:
        out, err = _end(up, agents)
    assert alive == [True, True], logs
    assert up.returncode == 0, err + out
    assert _steps(run) == 300
    assert all(agent.returncode == 0 for agent in agents), logs
    events = [json.loads(line)["event"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "lost" not in events and "restart" not in events, events


@pytest.mark.timeout(300)
def test_agents_on_other_hosts_still_leave_an_up_that_is_gone(tmp_path):
    up, agents, run = _remote_job(tmp_path)
    try:
        up.kill()
        up.wait(timeout=30)
        started = time.monotonic()
        logs = [agent.communicate(timeout=60)[0] for agent in agents]
        took = time.monotonic() - started
    finally:
        _end(up, agents)
    assert [agent.returncode for agent in agents] == [3, 3], logs
    # Between two tasks the stream's error was once logged as "the coordinator closed the command
    # stream", which a coordinator that ended the job says; a killed `up` is a lost coordinator.
    assert all("no heartbeat accepted for 10s" in log or "lost the coordinator" in log for log in logs), logs
    assert not any("closed the command stream" in log for log in logs), logs
    assert took < 40, took  # 10 s of silence, not the 600 s a coordinator that is there but silent gets
