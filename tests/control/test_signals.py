"""Ctrl-C, SIGTERM or SIGHUP (a closed terminal) on `hetlaunch up` mid-training stops every agent it
started, promptly."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
import pytest

from conftest import popen_hetlaunch, stop_process, wait_for

CLUSTER = """
name: signals
model: {preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}
train: {steps: 2000, micro_batch_size: 2, num_microbatches: 2}
nodes:  # pinned layers: no profiling, training starts at once
  - {name: s0, device: cpu, threads: 1, layers: [0, 2]}
  - {name: s1, device: cpu, threads: 1, layers: [2, 3]}
  - {name: s2, device: cpu, threads: 1, layers: [3, 4]}
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_signal_stops_up_and_every_agent(sig, tmp_path):
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(CLUSTER)
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir))
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 60,
                 "the first line of metrics.jsonl", proc=up)
        agents = psutil.Process(up.pid).children(recursive=True)
        agent_pids = [p.pid for p in agents if not _gone(p.pid)]
        assert len(agent_pids) >= 3, f"expected the 3 agents under `up` while it trains, found {agent_pids}"
        sent = time.monotonic()
        up.send_signal(sig)
        try:
            code = up.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`up` did not exit within 20 s of {sig.name}")
        took = time.monotonic() - sent
    finally:
        out, err = stop_process(up)
    assert code != 0, err + out
    assert "error:" in err and ("interrupted" in err or "terminated" in err), err
    still = [pid for pid in agent_pids if not _gone(pid)]
    assert not still, f"agents still running {took:.1f}s after {sig.name}: {still}"
    summary = run_dir / "summary.json"
    assert not summary.exists(), "an interrupted run must not look finished"


@pytest.mark.timeout(120)
def test_under_nohup_a_hangup_does_not_stop_up(tmp_path):
    """`nohup hetlaunch up ... &` ignores SIGHUP on purpose: up's own SIGHUP handling (a closed
    terminal unwinds like SIGTERM) must not undo that, or a logout ends the job (review)."""
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(CLUSTER)
    run_dir = tmp_path / "run"
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does; the child inherits it
    try:
        up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir))
    finally:
        signal.signal(signal.SIGHUP, before)
    try:
        metrics = run_dir / "metrics.jsonl"
        lines = lambda: metrics.read_text().count("\n") if metrics.exists() else 0  # noqa: E731
        wait_for(lambda: lines() >= 1, 60, "the first line of metrics.jsonl", proc=up)
        up.send_signal(signal.SIGHUP)
        seen = lines()
        wait_for(lambda: lines() >= seen + 3, 60, "steps after the hangup", proc=up)  # fails if up ended
        assert up.poll() is None
    finally:
        stop_process(up)
