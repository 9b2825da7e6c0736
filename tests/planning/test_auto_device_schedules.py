"""`schedule: auto` and the schedules with several stages per node (launcher/planning/request.py):
where the job can run them and a pipeline of its plan has 2 nodes or more, auto plans
interleaved 1F1B and ZB-V too (with as many pipelines at most) and takes the faster only for AUTO_DEVICE_SCHEDULE_GAIN more
tokens/s than its best one-stage-per-node plan; the note says what each was priced at, or why it
was not priced.

The profiles: equal nodes with all but free links, where the bubble is what differs. With few
micro-batches per node a one-stage-per-node pipeline idles for much of a step (1F1B's bubble,
ZB-H1's third of it) and ZB-V, two stages per node in a V with split backwards, fills it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml
from plan_reference import regions_profile
from rebalance_fixtures import profile as even_profile

from hetlaunch.launcher.adapt.replanner import Replanner, request_for
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.device_plans import check_device_priced
from hetlaunch.launcher.planning.profile_edits import subset
from hetlaunch.launcher.planning.request import PlanRequest, plan_for
from hetlaunch.runtime.registry import AUTO_DEVICE_SCHEDULE_GAIN, AUTO_SCHEDULES

NONE = CompressionConfig(intra_region="none", cross_region="none", sync="none")
REFUSED = "the test's job cannot"


def _profile():
    """Two equal nodes in one region, 8 layers of 10 ms a micro-batch, links all but free."""
    return regions_profile(per_region=2, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)


def _request(m: int, **extra) -> PlanRequest:
    """auto on one pipeline, device schedules allowed."""
    return PlanRequest(num_microbatches=m, schedule="auto", compression=NONE, max_pipelines=1,
                       device_schedules_refused=None, **extra)


@pytest.mark.parametrize("m", [1, 2])
def test_auto_takes_zb_v_where_it_beats_one_stage_per_node_by_the_margin(m):
    profile = _profile()
    auto = plan_for(profile, _request(m))
    one = plan_for(profile, replace(_request(m), device_schedules_refused=REFUSED))
    zb_v = plan_for(profile, replace(_request(m), schedule="zb-v"))
    assert one.schedule in AUTO_SCHEDULES and len(one.pipelines[0].cost.stages) == 2, one.schedule_choice
    assert f"interleaved-1f1b and zb-v not considered: {REFUSED}" in one.schedule_choice
    assert auto.schedule == "zb-v", auto.schedule_choice
    assert auto.tokens_per_s == zb_v.tokens_per_s >= one.tokens_per_s * AUTO_DEVICE_SCHEDULE_GAIN
    cost = auto.pipelines[0].cost
    assert [s.node for s in cost.stages] == [s.node for s in zb_v.pipelines[0].cost.stages]
    assert len(auto.pipelines) == 1 and len(cost.stages) == 4 and len({s.node for s in cost.stages}) == 2
    check_device_priced("zb-v", 2, cost)  # the step reported is the simulation of the stages returned
    if m == 1:  # interleaved 1F1B runs micro-batches in rounds of the nodes: no plan for one
        interleaved = "interleaved-1f1b no plan"
    else:
        priced = plan_for(profile, replace(_request(m), schedule="interleaved-1f1b")).tokens_per_s
        interleaved = f"interleaved-1f1b {priced:,.0f}"
    one_stage = one.schedule_choice.split("; interleaved-1f1b and zb-v not considered")[0]  # 1F1B, ZB-H1, ZB-H2 priced
    assert auto.schedule_choice.startswith(f"{one_stage}; several stages per node")
    assert f"several stages per node priced tokens/s {interleaved}, zb-v {zb_v.tokens_per_s:,.0f}; taken for 10% " \
           f"more or better; zb-v chosen" in auto.schedule_choice, auto.schedule_choice
    assert auto.schedule_choice.endswith("rebalancing is off under it")


def test_auto_keeps_one_stage_per_node_where_zb_v_is_faster_by_less_than_the_margin():
    """Four micro-batches on two nodes: ZB-H1 already hides most of the bubble; ZB-V is a few
    percent faster still, inside the margin, so auto keeps the one-stage-per-node plan."""
    profile = _profile()
    auto = plan_for(profile, _request(4))
    zb_v = plan_for(profile, replace(_request(4), schedule="zb-v"))
    assert auto.schedule in AUTO_SCHEDULES, auto.schedule_choice
    assert auto.tokens_per_s < zb_v.tokens_per_s < auto.tokens_per_s * AUTO_DEVICE_SCHEDULE_GAIN
    assert f"zb-v {zb_v.tokens_per_s:,.0f}; taken for 10% more or better" in auto.schedule_choice
    assert "chosen" not in auto.schedule_choice and "rebalancing" not in auto.schedule_choice


@pytest.mark.parametrize("change, why", [
    ({"global_batch": 8}, "a global batch"),
    ({"stages": 2}, "a stage count given"),
    ({"compression": CompressionConfig(intra_region="int8", cross_region="none", sync="none")}, "a pinned codec"),
    ({"max_pipelines": None}, "2 pipelines of one node each"),
])
def test_not_considered_where_the_request_or_the_plan_rules_them_out(change, why):
    """The same profile and batch where zb-v wins by the margin: not priced when the request asks
    for what they cannot run, or auto's plan is not one pipeline (here, with as many pipelines as
    pay off, two of one node each)."""
    auto = plan_for(_profile(), replace(_request(2), **change))
    assert auto.schedule in AUTO_SCHEDULES
    assert f"interleaved-1f1b and zb-v not considered: {why}" in auto.schedule_choice, auto.schedule_choice
    if why == "2 pipelines of one node each":
        assert len(auto.pipelines) == 2


def test_auto_weighs_zb_v_in_as_many_pipelines_as_its_one_stage_per_node_plan():
    """Four equal nodes, four micro-batches, as many pipelines as pay off: 1F1B's plan is two
    pipelines of two nodes, and ZB-V in two pipelines (two micro-batches each, four stages on two
    nodes) beats it by the margin. Auto once priced the device schedules only where its plan was
    one pipeline, and said "2 pipelines" here. A re-plan after a lost node keeps ZB-V, on at most
    as many pipelines."""
    profile = regions_profile(per_region=4, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)
    request = replace(_request(4), max_pipelines=None)
    auto = plan_for(profile, request)
    one = plan_for(profile, replace(request, device_schedules_refused=REFUSED))
    zb_v = plan_for(profile, replace(request, schedule="zb-v", max_pipelines=2))
    assert one.schedule in AUTO_SCHEDULES and [len(p.cost.stages) for p in one.pipelines] == [2, 2], one.schedule_choice
    assert auto.schedule == "zb-v", auto.schedule_choice
    assert [len(p.cost.stages) for p in auto.pipelines] == [4, 4]
    assert auto.tokens_per_s == zb_v.tokens_per_s >= one.tokens_per_s * AUTO_DEVICE_SCHEDULE_GAIN
    for p in auto.pipelines:
        check_device_priced("zb-v", 2, p.cost)
    assert "zb-v chosen (ZB-V: 2 pipelines, each 4 stages on 2 nodes, 2 each)" in auto.schedule_choice
    # what `up` plans with, on four equal nodes of the YAML's names; then node d is lost
    planner = Replanner(_cluster("abcd", 4, max_pipelines=2), even_profile({n: 0.01 for n in "abcd"}), lambda: ["a", "b", "c"])
    first, _ = planner.first()
    assert first.schedule == "zb-v" and len(first.pipelines()) == 2, first.schedule_choice
    again = planner.replan()
    assert again.schedule == "zb-v" and len(again.pipelines()) <= 2, again.schedule_choice
    assert {s.node for s in again.stages} == {"a", "b", "c"} or len(again.pipelines()) == 1


def test_not_considered_where_the_plan_is_one_node():
    """Two nodes a slow link apart (50 ms, 10 Mbit/s for 8 MiB activations): the whole model on one node."""
    profile = regions_profile(per_region=1, regions=("a", "b"), num_layers=8, layer_s=0.01)
    auto = plan_for(profile, _request(2))
    assert len(auto.pipelines) == 1 and len(auto.pipelines[0].cost.stages) == 1
    assert "interleaved-1f1b and zb-v not considered: one node" in auto.schedule_choice, auto.schedule_choice


def _cluster(names: str, m: int, **train):
    """Local CPU nodes, codecs none, `schedule` and `rebalance` left to their defaults unless given."""
    return parse_cluster(yaml.safe_dump({
        "name": "auto-dev", "model": {"preset": "tiny", "n_layers": 6, "seq_len": 32, "d_model": 32},
        "train": {"micro_batch_size": 4, "num_microbatches": m, **train},
        "compression": {"intra_region": "none", "cross_region": "none", "sync": "none"},
        "nodes": [{"name": n, "device": "cpu"} for n in names]}))


def test_up_plans_zb_v_with_rebalance_left_at_its_default_and_not_when_the_yaml_asks_for_it():
    """What `up` plans with (the replanner, its request from the whole YAML): two equal nodes, two
    micro-batches, one pipeline."""
    measured = even_profile({"a": 0.01, "b": 0.01})
    plan, result = Replanner(_cluster("ab", 2, max_pipelines=1), measured, lambda: ["a", "b"]).first()
    assert plan.schedule == result.schedule == "zb-v" and len(plan.stages) == 4, result.schedule_choice
    assert plan.schedule_choice.endswith("zb-v chosen (ZB-V: 4 stages on 2 nodes, 2 each): rebalancing is off under it")
    for rebalance in ("live", "restart"):
        asked = _cluster("ab", 2, max_pipelines=1, rebalance=rebalance)
        plan, _ = Replanner(asked, measured, lambda: ["a", "b"]).first()
        assert plan.schedule in AUTO_SCHEDULES
        assert f"interleaved-1f1b and zb-v not considered: train.rebalance is {rebalance}" in plan.schedule_choice


def test_a_replan_keeps_the_family_the_job_started_in():
    """After a lost node, a job that started on ZB-V re-plans ZB-V; one that started on one stage
    per node (here three pipelines of one node) stays there, though auto on the nodes left alone
    would now take ZB-V."""
    measured = even_profile({n: 0.01 for n in "abc"})
    device = Replanner(_cluster("abc", 2, max_pipelines=1), measured, lambda: ["a", "b"])
    assert device.first()[0].schedule == "zb-v"
    again = device.replan()
    assert again.schedule == "zb-v" and {s.node for s in again.stages} == {"a", "b"} and len(again.stages) == 4
    cluster = _cluster("abc", 3)
    one_stage = Replanner(cluster, measured, lambda: ["a", "b"])
    first, _ = one_stage.first()
    assert first.schedule in AUTO_SCHEDULES and len(first.pipelines()) == 3, first.schedule_choice
    fresh = plan_for(subset(measured, ["a", "b"]), request_for(cluster))
    assert fresh.schedule == "zb-v", fresh.schedule_choice  # what the family rule keeps it from
    again = one_stage.replan()
    assert again.schedule in AUTO_SCHEDULES, again.schedule_choice
    assert "not considered: the job runs one stage per node" in again.schedule_choice


def test_a_job_on_interleaved_1f1b_whose_nodes_left_do_not_divide_its_micro_batches_keeps_it_on_fewer():
    """Four equal nodes whose backward split costs half again as much as it whole (each half a
    layer's full time): ZB-V pays for the split, interleaved 1F1B does not, and auto takes the
    latter at four micro-batches. With a node lost, three nodes cannot run four micro-batches in
    rounds of three: the re-plan keeps the job's schedule (kept_family) on two of the three, the
    third left out saying why; it had been refused there and the job had gone over to ZB-V."""
    measured = even_profile({n: 0.01 for n in "abcd"})
    measured = measured.model_copy(update={"nodes": [
        n.model_copy(update={"input_grad_seconds": [0.005] * 8, "weight_grad_seconds": [0.005] * 8})
        for n in measured.nodes]})
    planner = Replanner(_cluster("abcd", 4, max_pipelines=1), measured, lambda: ["a", "b", "c"])
    first, _ = planner.first()
    assert first.schedule == "interleaved-1f1b", first.schedule_choice
    again = planner.replan()
    nodes = [s.node for s in again.stages]
    assert again.schedule == "interleaved-1f1b" and len(set(nodes)) == 2 and set(nodes) < {"a", "b", "c"}, \
        again.schedule_choice
    assert len(nodes) == 4 and nodes[:2] == nodes[2:]  # interleaved: stage s on node s mod 2
