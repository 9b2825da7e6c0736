"""Every port a running job listens on — the coordinator's and each worker's gloo ports — gets
garbage from a stranger: nothing answers an RPC or a store request without the token, and the
job trains on undisturbed."""

from __future__ import annotations

import json
import os
import socket

import grpc
import psutil
import pytest

from conftest import popen_hetlaunch, run_hetlaunch, stop_process, wait_for
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc

STEPS = 100_000  # the job runs until the test says `hetlaunch down`: 60 steps could end before its ports were listed


def _listening_ports(root: psutil.Process) -> dict[int, str]:
    """TCP ports that `up` and every process under it listen on, with who listens."""
    ports = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            for conn in proc.net_connections("inet"):
                if conn.status == psutil.CONN_LISTEN:
                    ports[conn.laddr.port] = " ".join(proc.cmdline()[1:4])
        except psutil.NoSuchProcess:
            pass
    return ports


def _garbage(port: int) -> None:
    for payload in (os.urandom(65536), b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(4096),
                    (2 ** 62).to_bytes(8, "little") * 64, b""):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(0.5)
                try:
                    s.recv(4096)
                except (socket.timeout, OSError):
                    pass
        except OSError:
            pass  # refused or reset: what a stranger should get


def _answers_without_token(port: int) -> str | None:
    """What a token-less RPC or store request gets from this port; None if it is refused."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = control_pb2_grpc.CoordinatorStub(channel)
        for call, request in ((stub.StoreOp, pb.StoreRequest(op="num_keys")), (stub.GetStatus, pb.GetStatusRequest())):
            try:
                call(request, timeout=3)
                return f"{call._method!r} answered"
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED):
                    return f"{err.code().name}: {err.details()}"
    return None


@pytest.mark.timeout(240)
def test_garbage_to_every_open_port_does_not_disturb_the_job(tmp_path):
    (tmp_path / "c.yaml").write_text(f"""
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4]}}
""")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir))
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, 120, "3 steps", proc=up)
        ports = _listening_ports(psutil.Process(up.pid))
        assert len(ports) >= 2, ports  # the coordinator, and the workers' gloo listeners
        for port in ports:
            assert _answers_without_token(port) is None, (port, ports[port])
            _garbage(port)
        after = len(metrics.read_text().splitlines())  # the job trains on after the garbage, then is stopped
        wait_for(lambda: len(metrics.read_text().splitlines()) >= after + 3, 120, "3 more steps", proc=up)
        stopped = run_hetlaunch("down", str(run_dir), timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        up.wait(timeout=150)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(len(records))) and len(records) < STEPS
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "lost" not in events and "restart" not in events, events
