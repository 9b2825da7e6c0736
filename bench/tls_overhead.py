"""What TLS on the control plane costs: tokens/s of the local example's shape with mutual TLS
÷ without, alternated (bench/_harness.py alternate), and the latency of one authenticated RPC
(GetStatus) over each. Training traffic is c10d, not the control plane, so the step should not
notice; agents report every step over gRPC, which is what TLS touches. Target ≥ 0.99.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import grpc

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir

TOKENS_PER_STEP = 8 * 4 * 64
TARGET = 0.99


def cluster(steps: int, certs: Path | None) -> str:
    tls = (f"  tls: {{cert: {certs}/coordinator.pem, key: {certs}/coordinator.key, ca: {certs}/ca.pem, "
           f"agent_cert: {certs}/agent.pem, agent_key: {certs}/agent.key}}\n") if certs else ""
    return f"""name: tls-{'on' if certs else 'off'}
coordinator:
  host: 127.0.0.1
{tls}model: {{preset: tiny}}
train: {{steps: {steps}, checkpoint_every: 0, seed: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 3]}}
  - {{name: b, device: cpu, threads: 1, layers: [3, 6]}}
"""


def rpc_latency_s(certs: Path | None, calls: int) -> float:
    """Median GetStatus round trip against a coordinator serving nobody (token checked each time)."""
    from hetlaunch.launcher.coordinator import CoordinatorServer
    from hetlaunch.protos import control_pb2 as pb
    from hetlaunch.protos import control_pb2_grpc
    from hetlaunch.runtime.tls import ClientTls, server_credentials

    creds = server_credentials(f"{certs}/coordinator.pem", f"{certs}/coordinator.key", f"{certs}/ca.pem") if certs else None
    server = CoordinatorServer("127.0.0.1", 0, "bench-token", ["a"], credentials=creds).start()
    try:
        channel = (grpc.secure_channel(server.address, ClientTls.read(f"{certs}/ca.pem", f"{certs}/agent.pem",
                                                                      f"{certs}/agent.key").credentials())
                   if certs else grpc.insecure_channel(server.address))
        stub = control_pb2_grpc.CoordinatorStub(channel)
        metadata = (("x-hetlaunch-token", "bench-token"),)
        stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=10)  # connect (and handshake) once
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=10)
            times.append(time.perf_counter() - start)
        channel.close()
        return statistics.median(times)
    finally:
        server.stop()


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    from hetlaunch.launcher.certs import init_certs

    reporter = reporter or NullReporter()
    steps, warmup, reps = (40, 5, 1) if quick else (200, 10, 3)
    certs = temporary_dir("hetlaunch-bench-certs-") / "certs"
    init_certs(certs, [])
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(2 * reps + 1)

    def side(with_tls: bool) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(steps, certs if with_tls else None), ["--run-dir", "{tmp}/run"], 900, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records]}
        return Side("tls" if with_tls else "clear", "mutual TLS" if with_tls else "clear text", once)

    measured = alternate(side(True), side(False), reps, reporter, retry_budget_s=300)
    result = compare(measured, "tls", "clear", TOKENS_PER_STEP, warmup, TARGET)
    latency = {"tls": rpc_latency_s(certs, 200), "clear": rpc_latency_s(None, 200)}
    return {
        "description": "tiny preset, 2 pinned local stages; mutual TLS on the control plane vs clear text",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "cluster": cluster(steps, Path("CERTS"))},
        **result,
        "rpc_latency_s": latency,
        "rpc_latency_ratio": latency["tls"] / latency["clear"],
        "measured": measured,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
