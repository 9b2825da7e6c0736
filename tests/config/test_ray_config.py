"""The YAML of launch: ray nodes (launcher/ray_config.py): the job-wide `ray:` section, a node's
own `ray:` bundle, and the one line when the ray extra is missing."""

from __future__ import annotations

import sys

import pytest

from conftest import error_of
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.extras import MissingExtra, check_extras

RAY = "ray: {address: '10.0.0.5:6379'}\n"


def test_a_ray_node_and_its_bundle() -> None:
    cluster = parse_cluster(RAY + "nodes:\n"
                            "  - {name: a, launch: ray, region: us, ray: {num_cpus: 4, num_gpus: 1, gpu_type: A100, "
                            "resources: {region_us: 1}}}\n"
                            "  - {name: b, launch: ray}\n"
                            "  - {name: c}\n")
    assert cluster.ray.address == "10.0.0.5:6379" and cluster.ray.strategy == "SPREAD"
    assert cluster.nodes[0].ray.bundle() == {"CPU": 4, "region_us": 1, "GPU": 1, "accelerator_type:A100": 0.001}
    assert cluster.nodes[1].ray is None  # the default bundle: one CPU
    assert parse_cluster("ray: {address: auto, strategy: STRICT_SPREAD}\nnodes: [{name: a, launch: ray}]").ray.address == "auto"


def test_ray_errors_are_one_line_naming_the_field() -> None:
    assert error_of("nodes: [{name: a, launch: ray}]") == (
        "cluster.yaml: ray: required with launch: ray nodes ({address: HOST:PORT of the Ray head, or auto})")
    assert error_of(RAY + "nodes: [{name: a}]") == "cluster.yaml: ray: set, but no node has launch: ray"
    assert "nodes[0].ray: only with launch: ray (this node has launch: local)" in \
        error_of(RAY + "nodes: [{name: a, ray: {num_gpus: 1}}, {name: b, launch: ray}]")
    assert "nodes[0].host: not with launch: ray (the placement group picks the Ray node)" in \
        error_of(RAY + "nodes: [{name: a, launch: ray, host: h1}]")
    assert "nodes[0].threads: only for local nodes" in error_of(RAY + "nodes: [{name: a, launch: ray, threads: 2}]")
    assert error_of("ray: {address: 'ray://head:10001'}\nnodes: [{name: a, launch: ray}]") == (
        "cluster.yaml: ray.address: must be HOST:PORT of the Ray head (as `ray start --head` prints it) or auto; "
        "Ray client (ray://) is not supported (got 'ray://head:10001')")
    assert error_of("ray: {address: '127.0.0.1:99999'}\nnodes: [{name: a, launch: ray}]") == (
        "cluster.yaml: ray.address: port 99999 is not a TCP port (1-65535)")  # it was dialled as 34463
    assert "ray.strategy: must be 'SPREAD'" in error_of("ray: {address: auto, strategy: spread}\n"
                                                        "nodes: [{name: a, launch: ray}]")
    assert "nodes[0].ray.resources" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {resources: {'a b': 1}}}]")
    assert "nodes[0].ray.num_gpus" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {num_gpus: -1}}]")
    # Ray refuses these itself, but only once `up` has reached the cluster, as a traceback (hostile review).
    assert "a resource Ray sets itself" in error_of(RAY + "nodes: [{name: a, launch: ray, "
                                                          "ray: {resources: {memory: 1}}}]")
    assert "finer than Ray counts" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {resources: {r: 0.00001}}}]")
    parse_cluster(RAY + "nodes: [{name: a, launch: ray, ray: {resources: {r: 0.0001, s: 2.5}}}]")
    assert "nodes[0].ray.gpus" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {gpus: 1}}]")


def test_without_the_ray_package_it_is_one_line(monkeypatch) -> None:
    cluster = parse_cluster(RAY + "nodes: [{name: a, launch: ray}]")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as when it is not installed
    with pytest.raises(MissingExtra) as info:
        check_extras(cluster)
    assert str(info.value) == "launch: ray needs the ray package: pip install 'hetlaunch[ray]'"


class _FakeRay:
    def __init__(self, nodes: list[dict]):
        self._nodes = nodes

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "Resources": r} for r in self._nodes] + [{"Alive": False, "Resources": {"gpu_x": 9}}]


def test_why_ray_did_not_place_the_agents() -> None:
    from hetlaunch.launcher.providers.ray import RayProvider

    cluster = parse_cluster(RAY + "nodes:\n  - {name: a, launch: ray, ray: {resources: {region_a: 1}}}\n"
                                  "  - {name: b, launch: ray, ray: {num_cpus: 4, resources: {region_b: 1}}}\n")
    provider = RayProvider(cluster.nodes)
    bundles = [n.ray.bundle() for n in cluster.nodes]
    provider.ray = _FakeRay([{"CPU": 2, "region_a": 2}])  # a dead node's resources do not count
    assert provider._why_unplaced(bundles, "SPREAD") == "no Ray node has resource region_b (node b asks for region_b: 1)"
    provider.ray = _FakeRay([{"CPU": 2, "region_a": 2}, {"CPU": 2, "region_b": 2}])
    assert provider._why_unplaced(bundles, "SPREAD") == ("no single Ray node has all that node b asks for "
                                                         "(CPU: 4, region_b: 1)")
    provider.ray = _FakeRay([{"CPU": 8, "region_a": 2, "region_b": 2}])
    assert provider._why_unplaced(bundles, "STRICT_SPREAD") == "STRICT_SPREAD needs 2 Ray nodes, the cluster has 1"
    assert provider._why_unplaced(bundles, "PACK").startswith("the 1 Ray node(s) have what each agent asks for, but "
                                                              "not free now or not together (PACK)")


def test_a_ray_node_with_other_versions_is_one_line(monkeypatch) -> None:
    from hetlaunch.launcher.job_errors import JobError
    from hetlaunch.launcher.providers.ray import RayProvider
    from hetlaunch.runtime.version import hetlaunch_version, torch_version

    provider = RayProvider(parse_cluster(RAY + "nodes: [{name: a, launch: ray}]").nodes)
    provider.actors = {}
    monkeypatch.setattr(provider, "_answers", lambda *_: {"a": {"hetlaunch": "0.0.1", "torch": "1.0", "host": "h1"}})
    with pytest.raises(JobError) as info:
        provider._check_versions()
    assert str(info.value) == (f"node a (Ray node h1): it has hetlaunch 0.0.1, torch 1.0; this machine has hetlaunch "
                               f"{hetlaunch_version()}, torch {torch_version()}; install the same there")
