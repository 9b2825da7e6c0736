"""`hetlaunch agent --serve`: one agent, started before any coordinator exists, serves two jobs
whose coordinators come and go on the same address (one of them killed mid-job), and ends
cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import hetlaunch_cmd, hetlaunch_env, popen_hetlaunch, run_hetlaunch, stop_process, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving_agent(tmp_path: Path) -> tuple[int, Path, subprocess.Popen]:
    """An agent service named r, started before any coordinator exists on the port it dials."""
    port = _free_port()
    token_file = tmp_path / "token"
    token_file.write_text("service-token\n")
    token_file.chmod(0o600)
    agent = subprocess.Popen(hetlaunch_cmd("agent", "--serve", "--coordinator", f"127.0.0.1:{port}", "--name", "r",
                                           "--token-file", str(token_file), "--connect-timeout", "2"),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=hetlaunch_env(OMP_NUM_THREADS="1"))
    return port, token_file, agent


@pytest.mark.timeout(240)
def test_one_agent_serves_two_jobs_and_stops_on_sigterm(tmp_path):
    port, token_file, agent = _serving_agent(tmp_path)
    try:
        for job in (1, 2):
            yaml = tmp_path / f"job{job}.yaml"
            yaml.write_text(f"""name: service
coordinator: {{host: 127.0.0.1, port: {port}, join_timeout_s: 60}}
model: {{preset: tiny, n_layers: 1, seq_len: 16, d_model: 16}}
train: {{steps: 2, micro_batch_size: 2, num_microbatches: 1, checkpoint_every: 0}}
nodes:
  - {{name: r, launch: remote, device: cpu}}
""")
            result = run_hetlaunch("up", str(yaml), "--run-dir", str(tmp_path / f"run{job}"), "--token-file",
                                   str(token_file), timeout=120)
            assert result.returncode == 0, result.stderr
            assert len((tmp_path / f"run{job}" / "metrics.jsonl").read_text().splitlines()) == 2
            assert agent.poll() is None, "the agent must outlive the job"
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate(timeout=10)
    assert agent.returncode == 0, err
    assert "job 2 ended" in err and "service stopped after 2 job(s)" in err, err
    assert "Traceback" not in err
    summary = json.loads((tmp_path / "run2" / "summary.json").read_text())
    assert summary["steps"] == 2


@pytest.mark.timeout(240)
def test_the_same_agent_serves_the_next_job_after_its_coordinator_was_killed(tmp_path):
    port, token_file, agent = _serving_agent(tmp_path)

    def yaml(steps: int) -> Path:
        path = tmp_path / f"job{steps}.yaml"
        path.write_text(f"""name: service
coordinator: {{host: 127.0.0.1, port: {port}, join_timeout_s: 90}}
model: {{preset: tiny, n_layers: 1, seq_len: 16, d_model: 16}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 1, checkpoint_every: 0}}
nodes:
  - {{name: r, launch: remote, device: cpu}}
""")
        return path

    try:
        first = popen_hetlaunch("up", str(yaml(100000)), "--run-dir", str(tmp_path / "run1"), "--token-file",
                                str(token_file))
        metrics = tmp_path / "run1" / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 90, "the first job's first step", proc=first)
        first.kill()  # the coordinator dies mid-job, without a word to the agent
        first.wait(timeout=10)
        stop_process(first)
        result = run_hetlaunch("up", str(yaml(2)), "--run-dir", str(tmp_path / "run2"), "--token-file",
                               str(token_file), timeout=150)
        assert result.returncode == 0, result.stderr
        assert agent.poll() is None, "the agent must outlive both jobs"
        agent.send_signal(signal.SIGTERM)
        out, err = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate(timeout=10)
    assert agent.returncode == 0, err
    assert "dialing 127.0.0.1" in err and "job 1 ended" in err and "service stopped after 1 job(s)" in err, err
    assert json.loads((tmp_path / "run2" / "summary.json").read_text())["steps"] == 2
