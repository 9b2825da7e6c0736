"""Text from other processes never drives the user's terminal, and `status` of a run that was
killed says what there is to see."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from conftest import run_hetlaunch
from hetlaunch.launcher.coordinator import CoordinatorServer
from hetlaunch.launcher.plain_text import plain
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from hetlaunch.runtime.version import hetlaunch_version, torch_version

HOSTILE = "boom \x1b]0;pwned\x07\x1b[2J\x1b[31mred\x9b1m \x00end\tand\nmore"


def test_plain_escapes_every_control_character_but_tab_and_newline():
    shown = plain(HOSTILE)
    assert not any(0 <= ord(c) < 32 and c not in "\t\n" or 0x7f <= ord(c) <= 0x9f for c in shown)
    assert shown == "boom \\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mred\\x9b1m \\x00end\tand\nmore"
    assert plain("x" * 5000, limit=10) == "x" * 10 + "..."


@pytest.mark.timeout(30)
def test_a_workers_failure_and_an_agents_hostname_arrive_without_escapes():
    server = CoordinatorServer("127.0.0.1", 0, "tok", ["a"]).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = control_pb2_grpc.CoordinatorStub(channel)
            meta = ((TOKEN_METADATA_KEY, "tok"),)
            agent = pb.AgentInfo(node_name="a", hostname="host\x1b[2J", agent_version=hetlaunch_version(),
                                 torch_version=torch_version(), pid=1)
            agent_id = stub.Register(pb.RegisterRequest(agent=agent), metadata=meta, timeout=10).agent_id
            stub.ReportResult(pb.ReportResultRequest(agent_id=agent_id, ok=False, error=HOSTILE,
                                                     generation=server.state.generation), metadata=meta, timeout=10)
        (node, result), = server.state.results()
        assert node == "a" and result.error == plain(HOSTILE) and "\x1b" not in result.error
        assert "\x1b" not in json.dumps(str(server.state.status()))
    finally:
        server.stop(0.5)


@pytest.mark.timeout(60)
def test_status_of_a_killed_run_says_it_wrote_no_summary(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "coordinator.json").write_text(json.dumps({"address": "127.0.0.1:9", "pid": gone.pid}))
    result = run_hetlaunch("status", str(run_dir), timeout=30)
    assert result.returncode == 1
    assert "wrote no summary.json" in result.stderr and "--resume" in result.stderr, result.stderr
    (run_dir / "summary.json").write_text("{}")
    assert f"see {run_dir / 'summary.json'}" in " ".join(run_hetlaunch("status", str(run_dir), timeout=30).stderr.split())
