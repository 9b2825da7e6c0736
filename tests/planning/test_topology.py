"""The topology of a plan: ranks, each node's stages, each layer's holders, the pipelines, the
checkpoint writers; built from real plans (an even split, pinned and planned pipelines) and from a
hand-made V-shaped plan where a node holds two stages, which features keyed by node refuse by name."""

from __future__ import annotations

import hashlib

import pytest
import yaml
from plan_reference import uniform_profile

from hetlaunch.launcher.checkpoint_book import CheckpointBook
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.planning.plan import Plan, StagePlan, planned, static_plan
from hetlaunch.launcher.planning.planner import plan as plan_from_profile
from hetlaunch.launcher.planning.topology import Placement, SeveralStagesError, Topology
from hetlaunch.launcher.step_aggregator import StepAggregator
from hetlaunch.launcher.stage_launch import layout_of
from hetlaunch.protos import control_pb2 as pb


def _cluster(nodes: list[dict], n_layers: int = 6, **train):
    return parse_cluster(yaml.safe_dump({
        "name": "topology", "model": {"preset": "tiny", "n_layers": n_layers, "seq_len": 32, "d_model": 32},
        "train": {"micro_batch_size": 4, "num_microbatches": 4, **train},
        "compression": {"intra_region": "none", "cross_region": "none", "sync": "none"},
        "nodes": [{"device": "cpu", **n} for n in nodes]}))


def _v_plan() -> Plan:
    """Pipeline 0 goes a -> b -> b -> a (a V: a holds its first and last stages); pipeline 1 is c -> d."""
    cuts = [("a", 0, 0, 2), ("b", 0, 2, 4), ("b", 0, 4, 6), ("a", 0, 6, 8), ("c", 1, 0, 5), ("d", 1, 5, 8)]
    return Plan(stages=tuple(StagePlan(node=n, region="r", layer_start=s, layer_end=e, pipeline=p)
                             for n, p, s, e in cuts),
                num_layers=8, micro_batch_size=4, num_microbatches=4, schedule="1f1b", source="pinned",
                pipeline_microbatches=(2, 2))


def _check_against_plan(plan: Plan, topology: Topology) -> None:
    """Ranks follow plan.stages; every layer has one holder per pipeline, the stage whose range holds it."""
    assert [(q.rank, q.node, q.pipeline, q.layer_start, q.layer_end) for q in topology.placements] == \
           [(r, s.node, s.pipeline, s.layer_start, s.layer_end) for r, s in enumerate(plan.stages)]
    assert [q.source for q in topology.placements] == list(plan.stages)
    assert [[q.source for q in stages] for stages in topology.pipelines] == [list(s) for s in plan.pipelines()]
    assert all(q.stage == j for stages in topology.pipelines for j, q in enumerate(stages))
    assert topology.nodes == tuple(dict.fromkeys(s.node for s in plan.stages))
    assert topology.num_layers == plan.num_layers
    for layer in range(plan.num_layers):
        holders = topology.holders(layer)
        assert [q.pipeline for q in holders] == list(range(len(plan.pipelines())))
        assert all(q.holds(layer) for q in holders)
    writers = topology.checkpoint_writers()
    assert sorted(layer for q in writers.values() for layer in q.layers) == list(range(plan.num_layers))
    assert all(q.pipeline == 0 and key == (q.node, q.stage) for key, q in writers.items())


def test_an_even_split_gives_one_stage_per_node_in_node_order():
    cluster = _cluster([{"name": "n0"}, {"name": "n1"}, {"name": "n2"}])
    plan = static_plan(cluster, 8)
    topology = Topology.of(plan)
    _check_against_plan(plan, topology)
    assert topology.nodes == ("n0", "n1", "n2") and len(topology.pipelines) == 1
    assert [topology.rank_of(n) for n in topology.nodes] == [0, 1, 2]
    assert [(q.layer_start, q.layer_end) for q in topology.by_node("a test").values()] == [(0, 3), (3, 6), (6, 8)]
    assert topology.stages_of("n1") == (topology.placements[1],) and topology.stages_of("elsewhere") == ()
    assert topology.only_stage("n2", "a test").rank == 2
    assert [q.node for q in topology.holders(5)] == ["n1"]
    assert list(topology.checkpoint_writers()) == [("n0", 0), ("n1", 1), ("n2", 2)]


def test_pinned_pipelines_rank_pipeline_after_pipeline_with_one_holder_each():
    cluster = _cluster([{"name": "a", "layers": [0, 3], "pipeline": 0}, {"name": "c", "layers": [0, 5], "pipeline": 1},
                        {"name": "b", "layers": [3, 8], "pipeline": 0}, {"name": "d", "layers": [5, 8], "pipeline": 1}])
    plan = static_plan(cluster, 8)
    topology = Topology.of(plan)
    _check_against_plan(plan, topology)
    assert [[q.node for q in stages] for stages in topology.pipelines] == [["a", "b"], ["c", "d"]]
    assert [topology.rank_of(n) for n in "abcd"] == [0, 1, 2, 3]
    assert [q.node for q in topology.holders(4)] == ["b", "c"] and topology.holder("c", 4).rank == 2
    assert list(topology.checkpoint_writers()) == [("a", 0), ("b", 1)]


def test_a_planned_plan_over_several_pipelines():
    names = ["n0", "n1", "n2", "n3"]
    # Memory for about half the layers, a fast link across: two pipelines of two stages.
    profile = uniform_profile([1.0, 1.0, 1.0, 1.0], ["x", "x", "y", "y"], num_layers=8, memory_gb=0.03,
                              cross_bandwidth=1e9, cross_latency=1e-5)
    result = plan_from_profile(profile, 8, max_pipelines=2)
    cluster = _cluster([{"name": n, "region": r} for n, r in zip(names, "xxyy")], num_microbatches=8)
    plan = planned(cluster, result)
    topology = Topology.of(plan)
    _check_against_plan(plan, topology)
    assert [len(stages) for stages in topology.pipelines] == [2, 2]
    # the map stage_launch used to build by hand
    assert {n: topology.rank_of(n) for n in names} == {s.node: r for r, s in enumerate(plan.stages)}
    # the planner's own pipelines (StageCosts) give the same nodes, as it asks for the ones it used
    assert Topology.of_pipelines(p.cost.stages for p in result.pipelines).nodes == topology.nodes
    # every sync group's nodes are the holders of its layers
    for group in plan.sync_plans():
        assert tuple(q.node for q in topology.holders(group.layer_start)) == group.nodes


def test_a_node_may_hold_two_stages():
    plan = _v_plan()
    topology = Topology.of(plan)
    _check_against_plan(plan, topology)
    assert topology.nodes == ("a", "b", "c", "d")
    assert [(q.rank, q.stage, q.layer_start) for q in topology.stages_of("a")] == [(0, 0, 0), (3, 3, 6)]
    assert [(q.rank, q.stage) for q in topology.stages_of("b")] == [(1, 1), (2, 2)]
    assert topology.rank_of("a", stage=3) == 3 and topology.rank_of("b", stage=1, pipeline=0) == 1
    assert topology.rank_of("c") == 4
    with pytest.raises(ValueError, match="node a holds 2 stages matching anything"):
        topology.rank_of("a")
    with pytest.raises(ValueError, match="node a holds 0 stages matching stage 1"):
        topology.rank_of("a", stage=1)
    assert [(q.node, q.rank) for q in topology.holders(7)] == [("a", 3), ("d", 5)]
    assert topology.holder("a", 1).rank == 0 and topology.holder("a", 6).rank == 3
    # two writers on a: their parts together with b's make the whole model
    assert list(topology.checkpoint_writers()) == [("a", 0), ("b", 1), ("b", 2), ("a", 3)]
    # what is keyed by rank takes it as it is
    assert [(s.rank, s.pipeline, s.layer_start, s.layer_end) for s in layout_of(plan)] == \
           [(q.rank, q.pipeline, q.layer_start, q.layer_end) for q in topology.placements]


def test_features_keyed_by_node_refuse_a_node_with_two_stages_by_name():
    topology = Topology.of(_v_plan())
    with pytest.raises(SeveralStagesError, match=r"^node a holds 2 stages; live moves supports one stage per node$"):
        topology.by_node("live moves")
    with pytest.raises(SeveralStagesError, match="node b holds 2 stages; calibration supports one stage per node"):
        topology.only_stage("b", "calibration")
    assert topology.only_stage("c", "calibration").rank == 4  # a node with one stage is answered
    with pytest.raises(SeveralStagesError, match="node a holds 2 stages; joining step reports"):
        StepAggregator(_v_plan())



def test_the_checkpoint_book_takes_each_stage_of_a_node_as_a_writer_told_by_its_first_layer(tmp_path):
    """A node with two stages writes two parts (one per stage); the layer a part starts at says
    which stage wrote it, and the checkpoint commits once every stage's part is in."""
    topology = Topology.of(_v_plan())
    book = CheckpointBook(tmp_path, keep=2, num_layers=8, extra={})
    book.expect(topology.checkpoint_writers())

    def part(start: int, end: int) -> pb.CheckpointPart:
        name, data = f"layers-{start}-{end}.safetensors", f"{start}-{end}".encode()  # what the manifest checks
        directory = tmp_path / "step-00000002"
        directory.mkdir(exist_ok=True)
        (directory / name).write_bytes(data)
        return pb.CheckpointPart(directory=str(directory), file=name, layer_start=start, layer_end=end, step=2,
                                 bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    assert book.add("a", part(0, 2)) is None and book.add("b", part(2, 4)) is None
    assert book.add("a", part(0, 2)) is None  # the same stage again completes nothing
    assert book.add("b", part(4, 6)) is None
    assert book.add("c", part(0, 5)) is None  # pipeline 1's stages are not writers
    assert book.add("a", part(6, 8)) == 2 and book.latest[0] == 2
    # A part sent again after its first copy arrived (an agent resends while `up` is stopped): one
    # checkpoint, each write time counted once (it committed twice, counting two checkpoints).
    assert book.add("a", part(6, 8)) is None and book.add("b", part(2, 4)) is None
    assert book.committed == 1 and len(book.write_s) == 4


def test_a_topology_refuses_placements_that_are_not_a_plan():
    q = Placement
    with pytest.raises(ValueError, match="rank order"):
        Topology((q(1, "a", 0, 0, 0, 4),))
    with pytest.raises(ValueError, match="must tile the layers"):
        Topology((q(0, "a", 0, 0, 0, 2), q(1, "b", 0, 1, 3, 4)))
    with pytest.raises(ValueError, match="pipeline 1 covers"):
        Topology((q(0, "a", 0, 0, 0, 4), q(1, "b", 1, 0, 0, 3)))
    with pytest.raises(ValueError, match="out of range"):
        Topology((q(0, "a", 0, 0, 0, 4),)).holders(4)
