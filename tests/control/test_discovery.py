"""discover: agents not listed by name join when they match, under the name and region they announce."""

from __future__ import annotations

import json
import subprocess

import pytest

from hetlaunch.launcher.discovery import Discovery, discovered_node
from hetlaunch.launcher.node_config import DiscoverConfig
from hetlaunch.protos import control_pb2 as pb

from conftest import error_of, hetlaunch_cmd, hetlaunch_env, popen_hetlaunch, run_hetlaunch, stop_process, wait_for


def _info(name: str, region: str = "eu", **labels: str) -> pb.AgentInfo:
    return pb.AgentInfo(node_name=name, region=region, labels=labels, hostname="box-1.example")


def test_rules_region_labels_room_and_closing() -> None:
    discovery = Discovery(DiscoverConfig(min_nodes=1, regions=["eu"], labels={"gpu": "a100"}), limit=2)
    assert "is in region us" in discovery.admit(_info("a", "us", gpu="a100"))
    assert "(none: --region not given)" in discovery.admit(_info("a", "", gpu="a100"))
    assert "lacks the label gpu=a100" in discovery.admit(_info("a", gpu="l4"))
    assert "is not a node name" in discovery.admit(_info("-rf", gpu="a100"))
    assert "version mismatch" in discovery.admit(_info("a", gpu="a100"), mismatch="version mismatch for node 'a'")
    assert discovery.admit(_info("a", gpu="a100", extra="ok")) is None
    assert discovery.admit(_info("b", gpu="a100")) is None
    assert "the most this job takes" in discovery.admit(_info("c", gpu="a100"))
    assert discovery.full() and discovery.close() == ["a", "b"]
    assert "discovery closed" in discovery.admit(_info("d", gpu="a100"))
    node = discovered_node(_info("a", gpu="a100"))
    assert (node.name, node.region, node.launch, node.host) == ("a", "eu", "remote", "box-1.example")


def test_yaml_checks(tmp_path) -> None:
    assert "discover.max_nodes: 1 is below min_nodes (2)" in error_of("discover: {min_nodes: 2, max_nodes: 1}")
    assert "discover.labels" in error_of("discover: {labels: {'-x': y}}")
    assert "discover: cannot be combined with pinned layers" in error_of(
        "discover: {}\nnodes: [{name: a, layers: [0, 6]}]")
    (tmp_path / "c.yaml").write_text("discover: {min_nodes: 2, max_nodes: 4, regions: [eu]}\n")
    out = run_hetlaunch("validate", str(tmp_path / "c.yaml"))
    assert out.returncode == 0, out.stderr
    assert "2 to 4 discovered agent(s) in region eu, waiting up to 60s" in out.stdout


def _agent(address: str, token_file, name: str, *flags: str, cwd) -> subprocess.Popen:
    return subprocess.Popen(hetlaunch_cmd("agent", "--coordinator", address, "--token-file", str(token_file),
                                          "--name", name, "--connect-timeout", "20", *flags),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=hetlaunch_env(OMP_NUM_THREADS="1"), cwd=cwd)


@pytest.mark.timeout(150)
def test_a_matching_agent_joins_and_trains_a_stranger_is_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("discovery-token\n")
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text("""
name: discover-test
model: {preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}
train: {steps: 3, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}
discover: {min_nodes: 2, max_nodes: 2, wait_s: 60, regions: [eu], labels: {gpu: a100}}
""")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), "--token-file", str(token_file))
    agents: list[subprocess.Popen] = []
    try:
        contact = run_dir / "coordinator.json"
        address = wait_for(lambda: contact.exists() and json.loads(contact.read_text() or "{}").get("address"), 30,
                           "the address in coordinator.json", proc=up)
        stranger = _agent(address, token_file, "l4-box", "--region", "eu", "--label", "gpu=l4", cwd=tmp_path)
        _, stranger_err = stranger.communicate(timeout=60)
        assert stranger.returncode == 1, stranger_err
        assert "lacks the label gpu=a100" in stranger_err
        agents += [_agent(address, token_file, name, "--region", "eu", "--label", "gpu=a100", cwd=tmp_path)
                   for name in ("a100-x", "a100-y")]
        up.wait(timeout=100)
        results = [a.communicate(timeout=30) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.communicate(timeout=10)
        up_out, up_err = stop_process(up)
    assert up.returncode == 0, up_err + up_out
    assert all(a.returncode == 0 for a in agents), results
    assert "discovered 2 node(s): " in up_out and "a100-x (eu" in up_out and "a100-y (eu" in up_out, up_out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert {s["node"] for s in summary["plan"]["stages"]} <= {"a100-x", "a100-y"}


@pytest.mark.timeout(120)
def test_too_few_agents_is_one_line_naming_the_refusals(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("discovery-token\n")
    yaml_path = tmp_path / "cluster.yaml"
    # 20 s for the refused agent to start and be refused: an agent's start took seconds on a loaded machine
    yaml_path.write_text("discover: {min_nodes: 1, wait_s: 20, regions: [eu]}\nnodes: [{name: here, device: cpu}]\n")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), "--token-file", str(token_file))
    try:
        contact = run_dir / "coordinator.json"
        address = wait_for(lambda: contact.exists() and json.loads(contact.read_text() or "{}").get("address"), 30,
                           "the address in coordinator.json", proc=up)
        wrong = _agent(address, token_file, "far", "--region", "us", cwd=tmp_path)
        wrong.communicate(timeout=30)
        up.wait(timeout=60)
    finally:
        up_out, up_err = stop_process(up)
    assert up.returncode == 1, up_out + up_err
    assert "discover: 0 agent(s) joined within 20s, min_nodes is 1; refused: agent 'far' is in region us" in up_err
