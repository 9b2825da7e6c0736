"""Which backend a data-plane group gets: NCCL only where every rank computes on a GPU of its own.

NCCL refuses two ranks on one GPU ("invalid usage" at the first collective): found on an H200
machine with three agents on its one GPU (bench/gpu_check.sh). The session asks the agents'
reports (the coordinator's real state) which GPU each node computes on.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.console import Console

from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.coordinator_state import CoordinatorState
from hetlaunch.launcher.session import ClusterSession
from hetlaunch.protos import control_pb2 as pb

pytestmark = pytest.mark.quick


def _session(tmp_path, devices: dict[str, str], reports: dict[str, tuple[str, list[pb.Device]]]) -> ClusterSession:
    nodes = "\n".join(f"  - {{name: {name}, device: '{device}'}}" for name, device in devices.items())
    cluster = parse_cluster(f"name: backends\nmodel: {{preset: tiny}}\nnodes:\n{nodes}\n")
    session = ClusterSession(cluster, tmp_path / "run", "token", Console(quiet=True))
    state = CoordinatorState(list(devices))
    for name, (host, gpus) in reports.items():
        state.register(pb.AgentInfo(node_name=name, hostname=host, devices=gpus, agent_version="v",
                                    torch_version="t"), ("v", "t"))
    session.server = SimpleNamespace(state=state)
    return session


def _gpus(*uuids: str) -> list[pb.Device]:
    return [pb.Device(kind=pb.DEVICE_KIND_CUDA, name="GPU", index=i, uuid=u) for i, u in enumerate(uuids)]


def test_three_nodes_on_one_gpu_get_gloo_and_on_three_gpus_nccl(tmp_path):
    one_gpu = _session(tmp_path, {"a": "cuda:0", "b": "cuda:0", "c": "cuda"},
                       {n: ("host", _gpus("GPU-1")) for n in "abc"})
    assert one_gpu.backend_for(["a", "b", "c"]) == "gloo"
    assert one_gpu.backend_for(["a"]) == "nccl"  # alone on its GPU
    three = _session(tmp_path, {"a": "cuda:0", "b": "cuda:1", "c": "cuda:2"},
                     {n: ("host", _gpus("GPU-1", "GPU-2", "GPU-3")) for n in "abc"})
    assert three.backend_for(["a", "b", "c"]) == "nccl"


def test_the_uuid_tells_gpus_apart_where_every_agent_sees_its_own_as_cuda_0(tmp_path):
    """Agents on one host each given one GPU by CUDA_VISIBLE_DEVICES all say cuda:0; their UUIDs differ."""
    own = _session(tmp_path, {"a": "cuda", "b": "auto"}, {"a": ("host", _gpus("GPU-1")), "b": ("host", _gpus("GPU-2"))})
    assert own.backend_for(["a", "b"]) == "nccl"
    shared = _session(tmp_path, {"a": "cuda", "b": "auto"}, {"a": ("h1", _gpus("GPU-1")), "b": ("h2", _gpus("GPU-1"))})
    assert shared.backend_for(["a", "b"]) == "gloo"


def test_without_uuids_the_host_and_index_decide(tmp_path):
    same_host = _session(tmp_path, {"a": "cuda:0", "b": "cuda:0"}, {n: ("host", _gpus("")) for n in "ab"})
    assert same_host.backend_for(["a", "b"]) == "gloo"
    two_hosts = _session(tmp_path, {"a": "cuda:0", "b": "cuda:0"}, {"a": ("h1", _gpus("")), "b": ("h2", _gpus(""))})
    assert two_hosts.backend_for(["a", "b"]) == "nccl"


def test_a_cpu_rank_means_gloo(tmp_path):
    mixed = _session(tmp_path, {"a": "cuda:0", "b": "cpu"},
                     {"a": ("h1", _gpus("GPU-1")), "b": ("h2", [pb.Device(kind=pb.DEVICE_KIND_CPU, name="x")])})
    assert mixed.backend_for(["a", "b"]) == "gloo"
