"""A node lost while the links are probed: it breaks the probe group, so the survivors' probes end
with its closed sockets; it is dropped, the others probe again without it, and the job trains on
them. A worker that dies while its agent lives is probed again with the others (under NCCL a dead
peer aborts the survivors' workers as well, so which died first cannot be told). Both used to end
the job. Either way the survivors' probes are aborted, not waited for: a kill that landed while the
group connected once left a's worker in gloo's connect past this test's 240 s (it waits up to five
times the rendezvous timeout for a peer that died mid-connect); the agents' side of the abort is
tested in tests/control/test_abort_targets.py."""

from __future__ import annotations

import signal

import psutil
import pytest

from conftest import hetlaunch_env, popen_hetlaunch, session_processes, stop_process, wait_for
from fault_run import agent_process, events, metrics, worker_of
from hetlaunch.launcher.planning.profile_file import load_profile

# The far node's link crosses 0.5 s each way, so its probe takes many seconds (12 s here): the kill,
# which waits for its worker to hold the probe group's sockets, lands inside it whatever the load.
CLUSTER = """
model: {entrypoint: "user_model:make_mlp_lm", kwargs: {seq_len: 16}}
train: {steps: 3, micro_batch_size: 2, num_microbatches: 2, max_pipelines: 1}
links:
  - between: [near, far]
    emulate: {latency_ms: 500}
nodes:
  - {name: a, region: near, device: cpu, threads: 1}
  - {name: b, region: near, device: cpu, threads: 1}
  - {name: far, region: far, device: cpu, threads: 1}
"""


def _probing(node: str) -> bool:
    """The node's worker has joined the probe group (connected to the rendezvous store): while
    its layers are timed it holds no socket."""
    try:
        return bool(worker_of(node).net_connections(kind="tcp"))
    except (AssertionError, psutil.Error):
        return False


def _hurt_far_while_probing(tmp_path, victim: str) -> tuple[str, str, object]:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    run_dir = tmp_path / "run"
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
    up = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), env=env)
    try:
        wait_for(lambda: _probing("far"), 150, "far's worker to join the probe group", up)
        (agent_process("far") if victim == "agent" else worker_of("far")).send_signal(signal.SIGKILL)
        up.wait(timeout=240)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]
    wait_for(lambda: not (session_processes("hetlaunch.runtime.agent") + session_processes("hetlaunch.runtime.worker")),
             30, "every agent and worker to be gone")
    return out, err, run_dir


@pytest.mark.timeout(300)
def test_a_node_lost_while_links_are_probed_is_dropped_and_the_others_probed_again(tmp_path):
    out, _, run_dir = _hurt_far_while_probing(tmp_path, "agent")
    assert "lost node far while probing links (" in out and "): planning without it" in out, out
    assert "probing the links again without far" in out, out
    assert [(e["node"], e["in_plan"]) for e in events(run_dir) if e["event"] == "lost"] == [("far", False)]
    plan = next(e for e in events(run_dir) if e["event"] == "generation")["plan"]
    assert {s["node"] for s in plan["stages"]} <= {"a", "b"}
    profile = load_profile(run_dir / "profile.json")  # refused if it kept a link of the dropped node
    assert [n.name for n in profile.nodes] == ["a", "b"]
    assert {r for link in profile.links if link.regions for r in link.regions} == {"near"}
    assert not [link for link in profile.links if "far" in (link.nodes or ())]


@pytest.mark.timeout(300)
def test_a_worker_that_dies_while_links_are_probed_is_probed_again(tmp_path):
    out, _, run_dir = _hurt_far_while_probing(tmp_path, "worker")
    assert "a worker died while probing links (far): probing again" in out, out
    assert not [e for e in events(run_dir) if e["event"] == "lost"]
    profile = load_profile(run_dir / "profile.json")
    assert [n.name for n in profile.nodes] == ["a", "b", "far"]
    assert {tuple(sorted(link.regions)) for link in profile.links if link.regions} == {("near", "near"), ("far", "near")}
