"""What nodes report while profiling is checked as a measurement before it is planned with or
cached: an agent that reported 0 bytes of memory or NaN seconds, or probed a node the cluster does
not have, ended `up` with a traceback (a hostile review). The coordinator's real state, real
report messages, the real profile cache in a temporary folder."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
from rich.console import Console

from hetlaunch.launcher.cluster_measurement import _assemble
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.coordinator_state import CoordinatorState
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.profile_cache import cache_dir
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.version import hetlaunch_version, torch_version

pytestmark = pytest.mark.quick

CLUSTER = """
name: reports
model: {preset: tiny, n_layers: 1, seq_len: 16, d_model: 32}
train: {steps: 2, micro_batch_size: 2, num_microbatches: 2}
nodes:
  - {name: a, region: east, device: cpu}
  - {name: b, region: west, device: cpu}
"""


def _session():
    cluster = parse_cluster(CLUSTER)
    state = CoordinatorState(["a", "b"])
    for name in ("a", "b"):
        state.register(pb.AgentInfo(node_name=name, hostname="h", agent_version=hetlaunch_version(),
                                    torch_version=torch_version(), pid=1, cpu_count=2),
                       (hetlaunch_version(), torch_version()))
    return SimpleNamespace(cluster=cluster, state=state, console=Console(file=io.StringIO()))


def _report(memory_bytes: int = 10**9, seconds: float = 0.01, peer: str = "b") -> pb.ReportProfileRequest:
    layer = pb.LayerProfile(seconds=seconds, optimizer_seconds=0.001, param_bytes=100, activation_bytes=100,
                            output_bytes=100)
    return pb.ReportProfileRequest(ok=True, device_name="cpu", memory_bytes=memory_bytes, layers=[layer] * 3,
                                   links=[pb.LinkProbe(peer_node=peer, latency_s=0.001, bandwidth_bytes_per_s=1e8)])


def _assembled(reports):
    spec = ModelSpec(gpt=GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=1, n_heads=2))
    return _assemble(_session(), spec, "m", 2, reports, reports, {}, {"a": "key-a", "b": "key-b"})


@pytest.mark.parametrize("bad,says", [
    (dict(memory_bytes=0), "memory_bytes"),
    (dict(seconds=math.nan), "layer_seconds"),
    (dict(seconds=5e-324), "layer_seconds"),
])
def test_a_report_that_is_not_a_measurement_is_one_line_and_not_cached(tmp_path, monkeypatch, bad, says):
    monkeypatch.setenv("HETLAUNCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(JobError, match=f"node a reported a profile that is not a measurement: {says}"):
        _assembled({"a": _report(**bad), "b": _report(peer="a")})
    assert not list(cache_dir().glob("*key-a*"))


def test_a_probe_of_a_node_the_cluster_does_not_have_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setenv("HETLAUNCH_CACHE_DIR", str(tmp_path))
    profile = _assembled({"a": _report(peer="nowhere"), "b": _report(peer="a")})
    assert [link.nodes for link in profile.links if link.nodes] == [("b", "a")]
    assert {n.name for n in profile.nodes} == {"a", "b"}
