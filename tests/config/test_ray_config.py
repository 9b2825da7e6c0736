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
    assert "ray.strategy: must be 'SPREAD'" in error_of("ray: {address: auto, strategy: spread}\n"
                                                        "nodes: [{name: a, launch: ray}]")
    assert "nodes[0].ray.resources" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {resources: {'a b': 1}}}]")
    assert "nodes[0].ray.num_gpus" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {num_gpus: -1}}]")
    assert "nodes[0].ray.gpus" in error_of(RAY + "nodes: [{name: a, launch: ray, ray: {gpus: 1}}]")


def test_without_the_ray_package_it_is_one_line(monkeypatch) -> None:
    cluster = parse_cluster(RAY + "nodes: [{name: a, launch: ray}]")
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError, as when it is not installed
    with pytest.raises(MissingExtra) as info:
        check_extras(cluster)
    assert str(info.value) == "launch: ray needs the ray package: pip install 'hetlaunch[ray]'"
