"""Hierarchical gradient sync in the planner: its price (launcher/planning/sync_cost.py), when
`sync_topology` lets it be chosen, and how a plan hands it to the stages (each rank's region)."""

from __future__ import annotations

import pytest
import yaml
from plan_reference import regions_profile

from hetlaunch.launcher.cluster_yaml import ConfigError, parse_cluster
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.planner import price_pipelines
from hetlaunch.launcher.planning.plan import static_plan
from hetlaunch.launcher.planning.profile_file import LinkProfile
from hetlaunch.launcher.planning.sync_cost import allreduce_s
from hetlaunch.launcher.planning.sync_groups import hierarchy_applies
from hetlaunch.launcher.stage_launch import data_parallel

MiB = 2**20
BYTES = 2 * 16 * MiB  # two layers of 16 MiB


def _six_replicas(policy: CompressionConfig, profile=None):
    """Six one-stage pipelines, three in region a and three in b: one sync group over all six."""
    profile = profile or regions_profile(per_region=3, num_layers=2, param_bytes=16 * MiB, output_bytes=MiB,
                                         cross_bandwidth=1.25e8, cross_latency=0.03)
    return price_pipelines(profile, [([n.name], [(0, 2)], 2) for n in profile.nodes], compression=policy)


def _hierarchical_s(cross_bw: float, cross_lat: float, codec: str = "none") -> float:
    """The module docstring's A_h, written out: a ring of 3 inside a region, the two leaders'
    exchange across, a one-to-two broadcast inside."""
    inside = 2 * 2 / 3 * BYTES / 1e10 + 4 * 1e-5
    broadcast = 2 * BYTES / 1e10 + 1e-5
    return inside + allreduce_s(BYTES, 2, cross_bw, cross_lat, codec) + broadcast


def test_the_hierarchical_price_and_the_flat_ring_it_beats():
    ring = _six_replicas(CompressionConfig(sync="none", sync_topology="ring"))
    (flat,) = ring.sync
    assert not flat.hierarchical
    assert flat.allreduce_s == pytest.approx(2 * 5 / 6 * BYTES / 1.25e8 + 10 * 0.03)
    auto = _six_replicas(CompressionConfig(sync="none"))
    (tiered,) = auto.sync
    assert tiered.hierarchical and tiered.codec == "none"
    assert tiered.allreduce_s == pytest.approx(_hierarchical_s(1.25e8, 0.03))
    assert tiered.allreduce_s < 0.7 * flat.allreduce_s  # one copy per region crosses, 2 slow hops not 10
    assert auto.step_s < ring.step_s
    pinned = _six_replicas(CompressionConfig(sync="none", sync_topology="hierarchical"))
    assert pinned.sync[0].hierarchical and pinned.sync[0].allreduce_s == pytest.approx(tiered.allreduce_s)


def test_a_codec_applies_to_the_leaders_exchange_only():
    auto = _six_replicas(CompressionConfig(sync="int8"))
    (g,) = auto.sync
    assert g.hierarchical and g.codec == "int8"
    assert g.allreduce_s == pytest.approx(_hierarchical_s(1.25e8, 0.03, "int8"))


def test_auto_keeps_the_ring_where_the_regions_inside_are_the_slow_part():
    profile = regions_profile(per_region=3, num_layers=2, param_bytes=16 * MiB, output_bytes=MiB,
                              cross_bandwidth=1e10, cross_latency=1e-5)
    profile = profile.model_copy(update={"links": [
        LinkProfile(regions=(r, r), bandwidth_bytes_per_s=1e7, latency_s=0.01) for r in ("a", "b")] + [
        link for link in profile.links if link.regions[0] != link.regions[1]]})
    (g,) = _six_replicas(CompressionConfig(sync="none"), profile).sync
    assert not g.hierarchical


def test_hierarchy_needs_two_regions_and_one_of_them_shared():
    assert hierarchy_applies(["a", "a", "b"]) and hierarchy_applies(["b", "a", "b", "a"])
    assert not hierarchy_applies(["a", "b", "c"]) and not hierarchy_applies(["a", "a"])
    profile = regions_profile(per_region=1, regions=("a", "b", "c"), num_layers=2, param_bytes=16 * MiB)
    result = price_pipelines(profile, [([n.name], [(0, 2)], 2) for n in profile.nodes],
                             compression=CompressionConfig(sync="none", sync_topology="hierarchical"))
    assert not result.sync[0].hierarchical  # one holder per region: nothing to sum first


def _cluster(topology: str):
    nodes = [{"name": "e0", "region": "east", "pipeline": 0, "layers": [0, 4]},
             {"name": "w0", "region": "west", "pipeline": 1, "layers": [0, 4]},
             {"name": "e1", "region": "east", "pipeline": 2, "layers": [0, 2]},
             {"name": "e2", "region": "east", "pipeline": 2, "layers": [2, 4]},
             {"name": "w1", "region": "west", "pipeline": 3, "layers": [0, 4]}]
    return parse_cluster(yaml.safe_dump({
        "name": "tiers", "model": {"preset": "tiny", "n_layers": 2, "seq_len": 32, "d_model": 32},
        "train": {"micro_batch_size": 2, "num_microbatches": 4},
        "compression": {"intra_region": "none", "cross_region": "none", "sync": "none", "sync_topology": topology},
        "nodes": [{"device": "cpu", **n} for n in nodes]}))


def test_a_pinned_plan_sends_each_rank_its_region_group():
    cluster = _cluster("hierarchical")
    plan = static_plan(cluster, 4)
    assert [(g.layer_start, g.layer_end, g.nodes, g.hierarchical) for g in plan.sync] == [
        (0, 2, ("e0", "w0", "e1", "w1"), True), (2, 4, ("e0", "w0", "e2", "w1"), True)]
    spec = data_parallel(cluster, plan)
    # Regions numbered by their first holder in pipeline order: east 0, west 1. Ranks follow the stages.
    assert [(list(g.ranks), list(g.region_of)) for g in spec.sync_groups] == [
        ([0, 1, 2, 4], [0, 1, 0, 1]), ([0, 1, 3, 4], [0, 1, 0, 1])]
    for topology in ("ring", "auto"):  # auto with nothing priced: a flat ring
        plan = static_plan(_cluster(topology), 4)
        assert not any(g.hierarchical for g in plan.sync)
        assert all(not g.region_of for g in data_parallel(_cluster(topology), plan).sync_groups)


def test_an_unknown_topology_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as error:
        _cluster("tree")
    message = str(error.value)
    assert "sync_topology" in message and "\n" not in message.strip()
