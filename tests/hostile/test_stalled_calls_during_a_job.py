"""64 calls that never send their message, made while a job trains, change nothing: without the
token they are refused on their headers (clear text) or in the TLS handshake (mutual TLS, no
certificate of the job's CA); 8 more stall health checks. The job trains every step and loses no
node. Before, 21 such calls stopped the heartbeats and ended the job: "no node is left to train on"."""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from conftest import popen_hetlaunch, run_hetlaunch, stop_process, wait_for
from hetlaunch.launcher.coordinator import SERVICE_NAME
from hetlaunch.protos import control_pb2 as pb
from stalled_calls import settle, stall

STEPS = 100_000  # the job trains until the test says `hetlaunch down`: 60 steps could end before the calls stalled
HEARTBEAT_TIMEOUT_S = 4  # the default, said in the YAML: the calls stay stalled longer than this while the job trains


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs") / "ca"
    result = run_hetlaunch("certs", "init", str(directory), timeout=60)
    assert result.returncode == 0, result.stderr
    return directory


def _cluster(tmp_path, certs_dir) -> str:
    tls = (f"tls: {{cert: {certs_dir}/coordinator.pem, key: {certs_dir}/coordinator.key, ca: {certs_dir}/ca.pem, "
           f"agent_cert: {certs_dir}/agent.pem, agent_key: {certs_dir}/agent.key}}, ") if certs_dir else ""
    path = tmp_path / "cluster.yaml"
    path.write_text(f"""name: stalled
coordinator: {{{tls}host: 127.0.0.1, heartbeat_timeout_s: {HEARTBEAT_TIMEOUT_S}}}
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4]}}
""")
    return str(path)


def _steps(run_dir) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["token", "mutual_tls"])
def test_a_job_trains_every_step_beside_64_stalled_calls(tmp_path, certs, mode):
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", _cluster(tmp_path, certs if mode == "mutual_tls" else None), "--run-dir", str(run_dir))
    stalled = []
    try:
        wait_for(lambda: len(_steps(run_dir)) >= 2, 150, "2 steps", proc=up)
        address = json.loads((run_dir / "coordinator.json").read_text())["address"]
        # Strangers: TLS that checks the server but has no certificate of its own, or clear text.
        credentials = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes()) if mode == "mutual_tls" else None
        stalled.append(stall(address, f"/{SERVICE_NAME}/Heartbeat", 64, credentials=credentials,
                             serializer=pb.HeartbeatRequest.SerializeToString,
                             deserializer=pb.HeartbeatResponse.FromString))
        stalled.append(stall(address, "/grpc.health.v1.Health/Check", 8, credentials=credentials,
                             serializer=health_pb2.HealthCheckRequest.SerializeToString,
                             deserializer=health_pb2.HealthCheckResponse.FromString))
        # Stalled for over a heartbeat timeout while the job trains: a node whose heartbeats the
        # calls held up would be lost by then. Then 3 more steps, and the job is stopped.
        stalled_at, steps_then = time.monotonic(), len(_steps(run_dir))
        wait_for(lambda: time.monotonic() - stalled_at > 1.5 * HEARTBEAT_TIMEOUT_S
                 and len(_steps(run_dir)) >= steps_then + 3, 150, "training on beside the stalled calls", proc=up)
        stopped = run_hetlaunch("down", str(run_dir), timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        up.wait(timeout=150)
    finally:
        for held in stalled:
            settle(*held)
        out, err = stop_process(up)
    assert up.returncode == 0, err + out
    steps = _steps(run_dir)
    assert steps == list(range(len(steps))) and len(steps) < STEPS
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] in ("lost", "restart")], events
