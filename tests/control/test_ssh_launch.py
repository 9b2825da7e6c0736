"""launch: ssh against a real OpenSSH server on 127.0.0.1: `up` checks the remote versions, starts
the agents through the system ssh client with the token on stdin, gathers their logs, and stops
them on exit and on Ctrl-C, leaving nothing running on the remote side."""

from __future__ import annotations

import json
import secrets
import signal
import sys
import time

import psutil
import pytest

from conftest import popen_hetlaunch, stop_process, wait_for
from ssh_server import start_sshd, sshd_missing

pytestmark = pytest.mark.skipif(sshd_missing() is not None, reason=sshd_missing() or "")


@pytest.fixture
def sshd(tmp_path):
    server = start_sshd(tmp_path / "sshd")
    yield server
    server.process.terminate()
    server.process.wait(timeout=10)


def _yaml(server, names: list[str], steps: int, remote_python: str = sys.executable) -> str:
    nodes = "\n".join(f"  - {{name: {n}, launch: ssh, host: 127.0.0.1, port: {server.port}, device: cpu, "
                      f"remote_python: {json.dumps(remote_python)}, ssh_options: {json.dumps(server.options())}}}"
                      for n in names)
    return f"""
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
coordinator: {{join_timeout_s: 60}}
nodes:
{nodes}
"""


def _remote_agents(names: list[str]) -> list[psutil.Process]:
    """Agents (and their workers' parents) that ssh started for these nodes, still alive."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "--stdin-lifeline" in cmd and any(f"--name={n}" in cmd for n in names):
            found.append(proc)
    return found


def _no_remote_agents_within(names: list[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _remote_agents(names) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _remote_agents(names)
    for proc in left:
        proc.kill()
    assert not left, f"remote agents left running: {[p.pid for p in left]}"


@pytest.mark.timeout(150)
def test_up_over_ssh_trains_keeps_the_token_off_command_lines_and_logs(tmp_path, sshd):
    names = [f"ssh{secrets.token_hex(3)}", f"ssh{secrets.token_hex(3)}"]
    (tmp_path / "c.yaml").write_text(_yaml(sshd, names, steps=3))
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir))
    try:
        token = wait_for(lambda: (run_dir / "token").exists() and (run_dir / "token").read_text().strip(), 30,
                         "the run's token", proc=up)
        seen_agents = False
        while up.poll() is None:  # ps on "either host" (one machine here) never shows the token
            for proc in psutil.process_iter(["cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                assert token not in cmd, f"the token is on a command line: {cmd[:200]}"
                seen_agents |= "--stdin-lifeline" in cmd
            time.sleep(0.2)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    assert seen_agents, "never saw the agents ssh started"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    for name in names:
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert f"[agent {name}] registered with" in log, log
        # The lifeline thread once held stdin's buffer lock at exit: every agent ended in SIGABRT.
        assert "Fatal Python error" not in log and "Aborted" not in log, log[-2000:]
    _no_remote_agents_within(names, 15)


@pytest.mark.timeout(150)
def test_ctrl_c_stops_the_remote_agents(tmp_path, sshd):
    names = [f"ssh{secrets.token_hex(3)}"]
    (tmp_path / "c.yaml").write_text(_yaml(sshd, names, steps=100000))
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip(),
                 90, "a first step", proc=up)
        assert _remote_agents(names), "the remote agent is not running"
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 130, out + err
    _no_remote_agents_within(names, 15)


@pytest.mark.timeout(60)
def test_remote_without_hetlaunch_or_with_other_versions_is_one_line(tmp_path, sshd):
    (tmp_path / "c.yaml").write_text(_yaml(sshd, ["bare"], steps=1, remote_python="/nonexistent/python3"))
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r1"))
    up.wait(timeout=45)
    out, err = stop_process(up)
    assert up.returncode == 1
    assert "node bare (ssh 127.0.0.1): /nonexistent/python3 there cannot load hetlaunch" in err, out + err

    fake = tmp_path / "old-python"
    fake.write_text("#!/bin/sh\necho hetlaunch 0.0.1\necho torch 1.0\n")
    fake.chmod(0o755)
    (tmp_path / "c.yaml").write_text(_yaml(sshd, ["old"], steps=1, remote_python=str(fake)))
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r2"))
    up.wait(timeout=45)
    out, err = stop_process(up)
    assert up.returncode == 1
    assert "node old (ssh 127.0.0.1): remote has hetlaunch 0.0.1, torch 1.0; this machine has hetlaunch" in err


@pytest.mark.timeout(60)
def test_unreachable_host_is_ssh_s_own_reason(tmp_path, sshd):
    text = _yaml(sshd, ["far"], steps=1).replace(f"port: {sshd.port}", "port: 1")
    (tmp_path / "c.yaml").write_text(text)
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "r"))
    up.wait(timeout=45)
    out, err = stop_process(up)
    assert up.returncode == 1
    assert "node far (ssh 127.0.0.1): ssh: connect to host 127.0.0.1 port 1: Connection refused" in err, out + err
