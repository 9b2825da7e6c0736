"""`hetlaunch status` and `down` against a real coordinator (gRPC on 127.0.0.1) with a token it
refuses, or a --token-file that is not there: bad input, exit 2 (a review: a refused token read
"did not answer" and exited 1, and a missing --token-file fell back to $HETLAUNCH_TOKEN)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from conftest import hetlaunch_env, run_hetlaunch
from finished_run import one_error_line
from hetlaunch.launcher.coordinator import CoordinatorServer

TOKEN = "test-token-123"


@pytest.fixture
def run_dir(tmp_path):
    server = CoordinatorServer("127.0.0.1", 0, TOKEN, ["a"]).start()
    try:
        (tmp_path / "coordinator.json").write_text(json.dumps({"address": server.address, "pid": os.getpid()}))
        (tmp_path / "token").write_text(TOKEN + "\n")
        yield tmp_path
    finally:
        server.stop(0.5)


@pytest.mark.timeout(120)
def test_a_refused_token_and_a_missing_token_file_are_bad_input(run_dir, tmp_path):
    assert run_hetlaunch("status", str(run_dir), timeout=30).returncode == 0  # the right token
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    for command in ("status", "down"):
        line = one_error_line(run_hetlaunch(command, str(run_dir), "--token-file", str(wrong), timeout=30), 2)
        assert "refused the token" in line, line
    env = {**hetlaunch_env(), "HETLAUNCH_TOKEN": TOKEN}  # what a missing --token-file fell back to
    line = one_error_line(run_hetlaunch("status", str(run_dir), "--token-file", str(tmp_path / "nowhere"),
                                        timeout=30, env=env), 2)
    assert "--token-file" in line and "no such file" in line, line


@pytest.mark.timeout(120)
def test_a_missing_tls_file_in_coordinator_json_is_named_as_that_file_names_it(tmp_path):
    """status and down said `--ca ...: no such file`, a flag neither has (the agent's; a hostile review)."""
    (tmp_path / "coordinator.json").write_text(json.dumps({"address": "127.0.0.1:1", "pid": os.getpid(),
                                                           "tls": {"ca": str(tmp_path / "gone.pem")}}))
    (tmp_path / "token").write_text(TOKEN + "\n")
    for command in ("status", "down"):
        result = run_hetlaunch(command, str(tmp_path), timeout=30)
        assert result.returncode == 2 and result.stderr == (f"error: {tmp_path}/coordinator.json: tls.ca "
                                                            f"{tmp_path}/gone.pem: no such file\n"), result.stderr


@pytest.mark.timeout(120)
def test_a_stale_run_whose_pid_another_process_took_since_is_not_followed(tmp_path):
    """Alive was `kill(pid, 0)`: after a reboot (or once pids wrap) a stale run directory's pid
    belongs to a process started since, and `logs -f` followed it forever (a hostile review)."""
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        contact = tmp_path / "coordinator.json"
        contact.write_text(json.dumps({"address": "127.0.0.1:1", "pid": stranger.pid}))
        hour_ago = time.time() - 3600
        os.utime(contact, (hour_ago, hour_ago))  # written before the process that holds its pid started
        (tmp_path / "token").write_text(TOKEN + "\n")
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "a.log").write_text("the last line\n")
        result = run_hetlaunch("logs", str(tmp_path), "a", "-f", timeout=30)
        assert result.returncode == 0 and result.stdout == "the last line\n", result
        result = run_hetlaunch("status", str(tmp_path), timeout=30)
        assert result.returncode == 1 and "is not running; the run has ended" in result.stderr, result.stderr
        os.utime(contact, None)  # written now, after the process started: it may be the coordinator
        result = run_hetlaunch("status", str(tmp_path), timeout=30)
        assert "is not running" not in result.stderr, result.stderr
    finally:
        stranger.kill()
        stranger.wait()


def test_logs_of_a_folder_that_is_not_there_says_so(tmp_path):
    """It said "no log for node 'a' in this run" of a run directory that does not exist (a hostile review)."""
    result = run_hetlaunch("logs", str(tmp_path / "no_such_run"), "a", timeout=30)
    assert result.returncode == 2 and result.stderr == (f"error: {tmp_path}/no_such_run: not a run directory "
                                                        "(no such folder)\n"), result.stderr
