"""A node lost while the links are probed: it breaks the probe group, so the survivors' probes end
with its closed sockets; it is dropped, the others probe again without it, and the job trains on
them. It used to end the job."""

from __future__ import annotations

import signal

import psutil
import pytest

from conftest import hetlaunch_env, popen_hetlaunch, session_processes, stop_process, wait_for
from fault_run import agent_process, events, metrics, worker_of

# The far node's link crosses 2 s each way, so its probe takes many seconds: the kill, which waits
# for its worker to hold the probe group's sockets, lands inside it whatever the load.
CLUSTER = """
model: {entrypoint: "user_model:make_mlp_lm", kwargs: {seq_len: 16}}
train: {steps: 3, micro_batch_size: 2, num_microbatches: 2, max_pipelines: 1}
links:
  - between: [near, far]
    emulate: {latency_ms: 2000}
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", ["agent", "worker"])
def test_a_node_lost_while_links_are_probed_is_dropped_and_the_others_probed_again(tmp_path, victim):
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
    assert "lost node far while probing links (" in out and "): planning without it" in out, out
    assert "probing the links again without far" in out, out
    assert [(e["node"], e["in_plan"]) for e in events(run_dir) if e["event"] == "lost"] == [("far", False)]
    plan = next(e for e in events(run_dir) if e["event"] == "generation")["plan"]
    assert {s["node"] for s in plan["stages"]} <= {"a", "b"}
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]
    profile = (run_dir / "profile.json").read_text()
    assert '"far"' not in profile  # neither its layers nor a link of it
    wait_for(lambda: not (session_processes("hetlaunch.runtime.agent") + session_processes("hetlaunch.runtime.worker")),
             30, "every agent and worker to be gone")
