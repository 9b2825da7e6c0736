"""Plans for interleaved 1F1B and ZB-V (launcher/planning/device_plans.py): 1F1B's nodes, v·D stages
placed as the schedule says, the cut chosen by simulation, and the step reported exactly
`simulate_devices` of what is returned."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from plan_reference import random_profile, regions_profile

from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.pipeline_cost import split_costs
from hetlaunch.launcher.planning.device_plans import _CutSearch, _weights_final, check_device_priced
from hetlaunch.launcher.planning.planner import PlanInvariantError
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.profile_edits import scaled
from hetlaunch.launcher.planning.request import PlanRequest, plan_for
from hetlaunch.runtime.device_schedules import device_schedule_named, timed_zb_v
from hetlaunch.runtime.simulation import simulate_devices

NONE = CompressionConfig(intra_region="none", cross_region="none", sync="none")


def _request(schedule: str, m: int = 4, **extra) -> PlanRequest:
    return PlanRequest(num_microbatches=m, schedule=schedule, compression=NONE, max_pipelines=1, **extra)


def _slow_second(profile, factor: float):
    nodes = list(profile.nodes)
    nodes[1] = nodes[1].model_copy(update={"layer_seconds": [t * factor for t in nodes[1].layer_seconds]})
    return profile.model_copy(update={"nodes": nodes})


def _lists(schedule: str, cost, D: int) -> list:
    """The devices' actions the plan says it runs: the schedule's own, or ZB-V's timed order built
    here from the stages' costs (I and W as measured, else half the backward each)."""
    if cost.device_order != "timed":
        return device_schedule_named(schedule).actions(D, cost.num_microbatches)
    assert schedule == "zb-v"
    stages = cost.stages
    measured = split_costs(stages)
    input_grad, weight_grad = measured if measured[0] is not None else ([s.backward_s / 2 for s in stages],) * 2
    return timed_zb_v(D, cost.num_microbatches, [s.forward_s for s in stages], input_grad, weight_grad,
                      [s.link_s + s.latency_s for s in stages[:-1]])


def _step(schedule: str, cost, D: int) -> float:
    placed = device_schedule_named(schedule)
    where = [placed.stage_device(s, D) for s in range(len(cost.stages))]
    stages = cost.stages
    return simulate_devices(_lists(schedule, cost, D), [s.forward_s for s in stages],
                            [s.backward_s for s in stages], [s.link_s for s in stages[:-1]],
                            [s.latency_s for s in stages[:-1]],
                            [sum(s.optimizer_s for j, s in enumerate(stages) if where[j] == d) for d in range(D)],
                            *split_costs(stages))


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_stages_follow_the_placement_and_the_step_is_their_simulation(schedule):
    profile = _slow_second(regions_profile(per_region=2, regions=("a",), num_layers=12, layer_s=0.01,
                                           output_bytes=2**16), 2.0)
    result = plan_for(profile, _request(schedule))
    assert result.schedule == schedule and len(result.pipelines) == 1
    cost = result.pipelines[0].cost
    chain = list(dict.fromkeys(s.node for s in cost.stages))
    D = len(chain)
    placed = device_schedule_named(schedule)
    assert len(cost.stages) == placed.num_stages(D)
    assert [s.node for s in cost.stages] == [chain[placed.stage_device(s, D)] for s in range(len(cost.stages))]
    assert [s.layer_start for s in cost.stages[1:]] == [s.layer_end for s in cost.stages[:-1]]
    assert cost.stages[0].layer_start == 0 and cost.stages[-1].layer_end == 12
    assert result.step_s == cost.step_s == _step(schedule, cost, D)  # exactly, not approximately
    check_device_priced(schedule, D, cost)
    # a link inside a node is free; between nodes it is priced
    for s, stage in enumerate(cost.stages[:-1]):
        same = placed.stage_device(s, D) == placed.stage_device(s + 1, D)
        assert (stage.link_s == 0 and stage.latency_s == 0) if same else stage.latency_s > 0


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_the_cut_is_no_worse_than_any_cut_in_a_brute_force_on_a_small_model(schedule):
    """Six layers, four stages: every cut priced; the local search's must be among the best."""
    profile = _slow_second(regions_profile(per_region=2, regions=("a",), num_layers=6, layer_s=0.01,
                                           output_bytes=2**16), 3.0)
    result = plan_for(profile, _request(schedule))
    cost = result.pipelines[0].cost
    chain = [profile.node(n) for n in dict.fromkeys(s.node for s in cost.stages)]
    placed = device_schedule_named(schedule)
    search = _CutSearch(CostModel(profile, 4, "1f1b", NONE), chain, placed, placed.actions(len(chain), 4))
    best = min(search.cost(bounds).step_s for bounds in itertools.combinations(range(1, 6), 3))
    assert result.step_s <= best * 1.05  # a hill climb: within 5% of the best cut on this small model


def test_a_report_that_is_not_the_simulation_is_a_planner_bug():
    profile = regions_profile(per_region=2, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)
    cost = plan_for(profile, _request("zb-v")).pipelines[0].cost
    with pytest.raises(PlanInvariantError, match="simulate to"):
        check_device_priced("zb-v", 2, replace(cost, step_s=cost.step_s * 0.9))


def test_zb_v_runs_the_order_built_at_its_stages_costs_where_that_is_faster():
    """Four nodes in four regions, 5 ms apart: the plan's devices run ZB-V's order built at its
    stages' costs (runtime/device_schedules.py timed_zb_v), which simulates 12% faster than the
    unit order at the same cut. The step reported is that order's simulation: the same stages
    reported under the unit order are a planner bug."""
    profile = regions_profile(per_region=1, regions=("a", "b", "c", "d"), num_layers=8, layer_s=0.02,
                              output_bytes=2**16, cross_bandwidth=1e9, cross_latency=0.005)
    cost = plan_for(profile, _request("zb-v")).pipelines[0].cost
    chain = [profile.node(n) for n in dict.fromkeys(s.node for s in cost.stages)]
    assert cost.device_order == "timed" and len(chain) == 4
    assert cost.step_s == _step("zb-v", cost, 4)  # the timed lists, built again here from the stages
    check_device_priced("zb-v", 4, cost)
    placed = device_schedule_named("zb-v")
    bounds = tuple(s.layer_end for s in cost.stages[:-1])
    unit = _CutSearch(CostModel(profile, 4, "1f1b", NONE), chain, placed, placed.actions(4, 4)).cost(bounds)
    assert cost.step_s < 0.9 * unit.step_s, (cost.step_s, unit.step_s)
    with pytest.raises(PlanInvariantError, match="simulate to"):
        check_device_priced("zb-v", 4, replace(cost, device_order=""))


def test_refusals_say_why():
    profile = regions_profile(per_region=2, regions=("a",), num_layers=3, layer_s=0.01, output_bytes=2**16)
    with pytest.raises(PlanningError, match="needs 4 stages but the model has only 3 layers"):
        plan_for(profile, _request("zb-v"))
    profile = regions_profile(per_region=2, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)
    with pytest.raises(PlanningError, match="not a multiple of 2"):
        plan_for(profile, _request("interleaved-1f1b", m=3))
    with pytest.raises(PlanningError, match="no global batch"):
        plan_for(profile, _request("zb-v", global_batch=16))
    # two pipelines of two nodes take 3 micro-batches as 2 + 1: interleaved's rounds of 2 do not fit the 1
    four = regions_profile(per_region=4, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)
    with pytest.raises(PlanningError, match=r"pipeline \d takes \d of the 6 micro-batches: .*not a multiple of 2"):
        plan_for(four, replace(_request("interleaved-1f1b", m=6), max_pipelines=2))


def test_interleaved_leaves_out_the_nodes_its_micro_batches_do_not_suit():
    """Rounds of its devices: 3 nodes at 4 micro-batches were refused (validate had passed the YAML,
    up failed once its agents were up), and so was a recovery whose survivors did not divide them.
    Now the best sub-chain of the most nodes that do, the rest left out saying why."""
    profile = _slow_second(regions_profile(per_region=3, regions=("a",), num_layers=8, layer_s=0.01,
                                           output_bytes=2**16), 3.0)
    result = plan_for(profile, _request("interleaved-1f1b", m=4))
    cost = result.pipelines[0].cost
    assert [s.node for s in cost.stages] == ["a0", "a2", "a0", "a2"]  # the slow a1 left out, not a2
    assert result.excluded == {"a1": "interleaved 1F1B runs micro-batches in rounds of its nodes: 4 suit 2 of "
                                     "this pipeline's 3"}
    check_device_priced("interleaved-1f1b", 2, cost)
    assert plan_for(profile, _request("interleaved-1f1b", m=6)).excluded == {}  # 3 divides 6: all three


def test_a_chain_with_more_sub_chains_than_are_tried_takes_its_fastest_nodes():
    """Past MAX_SUBCHAINS sub-chains the fastest nodes are taken: they were gathered in a set of
    NodeProfiles, which are not hashable, and every plan of 12 nodes at 4 micro-batches under
    interleaved 1F1B ended in a TypeError traceback (a hostile review)."""
    profile = regions_profile(per_region=12, regions=("a",), num_layers=24, layer_s=0.01, output_bytes=2**16)
    nodes = list(profile.nodes)
    for i in (0, 2, 5):
        nodes[i] = nodes[i].model_copy(update={"layer_seconds": [t * 3.0 for t in nodes[i].layer_seconds]})
    profile = profile.model_copy(update={"nodes": nodes})
    result = plan_for(profile, _request("interleaved-1f1b", m=4))
    cost = result.pipelines[0].cost
    used = {s.node for s in cost.stages}
    assert len(used) == 4 and not used & {"a0", "a2", "a5"}, used
    check_device_priced("interleaved-1f1b", 4, cost)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_random_profiles_plan_honestly_or_say_no_plan(schedule):
    """Small random clusters with extreme speeds and memories that may not fit: a plan whose step is
    its simulation, placed as the schedule says, within each node's memory; or one line saying why not."""
    rng = random.Random(5)
    plans = refusals = 0
    for _ in range(60):
        profile = random_profile(rng, rng.randint(1, 4), rng.randint(1, 2), rng.randint(2, 9), memory_gb=(0.01, 3.0))
        profile = scaled(profile, {n.name: rng.choice([1.0, 1.9, 3.3, 1e-3, 1e3]) for n in profile.nodes})
        try:
            result = plan_for(profile, _request(schedule, m=rng.choice([2, 4, 6, 8])))
        except PlanningError as err:
            assert "\n" not in str(err)
            refusals += 1
            continue
        plans += 1
        cost = result.pipelines[0].cost
        D = len(dict.fromkeys(s.node for s in cost.stages))
        check_device_priced(schedule, D, cost)
        held: dict[str, float] = {}
        for stage in cost.stages:
            held[stage.node] = held.get(stage.node, 0.0) + stage.memory_bytes
        assert all(held[n] <= profile.node(n).memory_bytes for n in held)
    assert plans > 10 and refusals > 2, (plans, refusals)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_two_pipelines_each_cut_for_its_share_and_priced_with_their_sync(schedule):
    """Four alike nodes, max_pipelines 2: 1F1B's plan takes two pipelines of two nodes, two
    micro-batches each; each is cut as one pipeline is, at its share, its step exactly its
    simulation, and the plan's step is the later of those and the sync groups' ends."""
    profile = regions_profile(per_region=4, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)
    result = plan_for(profile, replace(_request(schedule), max_pipelines=2))
    assert [p.cost.num_microbatches for p in result.pipelines] == [2, 2]
    placed = device_schedule_named(schedule)
    chains = []
    for pipeline in result.pipelines:
        cost = pipeline.cost
        chain = list(dict.fromkeys(s.node for s in cost.stages))
        assert len(chain) == 2 and [s.node for s in cost.stages] == [chain[placed.stage_device(s, 2)] for s in range(4)]
        assert cost.step_s == _step(schedule, cost, 2)
        check_device_priced(schedule, 2, cost)
        chains.append(chain)
    assert not set(chains[0]) & set(chains[1])  # a node serves one pipeline
    # one sync group per layer run with one holder set, holders one node of each pipeline
    assert result.sync and [(g.layer_start, g.layer_end) for g in result.sync] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(g.nodes[0] in chains[0] and g.nodes[1] in chains[1] for g in result.sync)
    assert result.step_s == max([p.cost.step_s for p in result.pipelines] + [g.end_s for g in result.sync])
    # a group's sync starts when its holders' stages have ended their last backward or weight
    # gradient in their pipelines' simulated steps, and takes its whole reduction from there
    done = [_weights_final(schedule, p.cost) for p in result.pipelines]
    for g in result.sync:
        holders = [next(j for j, s in enumerate(p.cost.stages) if s.layer_start <= g.layer_start < s.layer_end)
                   for p in result.pipelines]
        ready = max(done[p][j] for p, j in enumerate(holders))
        assert g.allreduce_s > 0 and g.end_s >= ready + g.allreduce_s * (1 - 1e-12), g
    first = min(result.sync, key=lambda g: g.end_s)  # nothing ahead of it on its links
    holders = [next(j for j, s in enumerate(p.cost.stages) if s.layer_start <= first.layer_start < s.layer_end)
               for p in result.pipelines]
    assert first.end_s == pytest.approx(max(done[p][j] for p, j in enumerate(holders)) + first.allreduce_s, rel=1e-12)
    assert "last backward or weight gradient" in result.sync_pricing
    assert result.schedule_choice.startswith(f"{placed.title}: 2 pipelines, each 4 stages on 2 nodes")
    # max_pipelines 1 (and auto) plans one pipeline, as before
    assert len(plan_for(profile, _request(schedule)).pipelines) == 1
    assert len(plan_for(profile, replace(_request(schedule), max_pipelines=None)).pipelines) == 1


def test_random_profiles_with_two_pipelines_plan_honestly_or_say_no_plan():
    rng = random.Random(11)
    plans = two = 0
    for _ in range(30):
        profile = random_profile(rng, rng.randint(1, 4), rng.randint(1, 2), rng.randint(2, 9), memory_gb=(0.01, 3.0))
        try:
            result = plan_for(profile, replace(_request("zb-v", m=rng.choice([2, 4, 6])), max_pipelines=2))
        except PlanningError as err:
            assert "\n" not in str(err)
            continue
        plans += 1
        two += len(result.pipelines) == 2
        for pipeline in result.pipelines:
            cost = pipeline.cost
            check_device_priced("zb-v", len(dict.fromkeys(s.node for s in cost.stages)), cost)
        assert result.step_s >= max(p.cost.step_s for p in result.pipelines)
    assert plans and two  # some of them two pipelines


def test_a_pinned_boundary_codec_is_priced_on_its_stage_and_refused_inside_a_node():
    """compression.boundaries names the schedule's own boundaries (after stage s): int8 on ZB-V's
    boundary 0 (node 0 to node 1) is that stage's codec, its link priced at int8's bytes and its
    codec work on the stage; boundary 1 is inside ZB-V's second node, and boundary 3 does not exist."""
    profile = regions_profile(per_region=2, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**16)
    pinned = CompressionConfig(intra_region="none", cross_region="none", sync="none", boundaries={0: "int8"})
    result = plan_for(profile, replace(_request("zb-v"), compression=pinned))
    stages = result.pipelines[0].cost.stages
    assert [s.codec for s in stages] == ["int8", "none", "none", "none"]
    assert 0 < stages[0].link_s < stages[0].link_uncompressed_s
    assert stages[2].link_s == stages[2].link_uncompressed_s > 0  # the other boundary between nodes: none
    check_device_priced("zb-v", 2, result.pipelines[0].cost)
    assert result.compression.boundaries == {0: "int8"}  # carried to the plan: its links run int8
    for boundary, why in ((1, "inside node"), (3, "has boundaries 0 to 2")):
        codec = pinned.model_copy(update={"boundaries": {boundary: "int8"}})
        with pytest.raises(PlanningError, match=why):
            plan_for(profile, replace(_request("zb-v"), compression=codec))


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_a_small_node_that_overflows_both_starts_still_gets_a_cut_that_fits(schedule):
    """The cut search climbed from an even cut and one by speed only: where both put more layers on
    a small node than it holds, the chain was refused though cuts fit (a hostile review). It then
    climbs from a cut by memory; its plan is the best of every cut that fits."""
    from hetlaunch.launcher.planning.compression import NONE
    from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile

    L, M, MiB = 8, 8, 2**20
    nodes = [NodeProfile(name="a", region="r", device="d", memory_bytes=10 * MiB, layer_seconds=[0.01] * L),
             NodeProfile(name="b", region="r", device="d", memory_bytes=2**36, layer_seconds=[0.02] * L)]
    profile = Profile(model=ModelIdentity(description="m", num_layers=L), micro_batch_size=4, seq_len=64,
                      layers=[LayerInfo(param_bytes=MiB, activation_bytes=0, output_bytes=MiB)] * L, nodes=nodes,
                      links=[LinkProfile(regions=("r", "r"), bandwidth_bytes_per_s=1e10, latency_s=1e-5)])
    result = plan_for(profile, PlanRequest(num_microbatches=M, schedule=schedule, compression=NONE))
    cost = result.pipelines[0].cost
    held = {n.name: 0.0 for n in nodes}
    for stage in cost.stages:
        held[stage.node] += stage.memory_bytes
    assert all(held[n.name] <= n.memory_bytes for n in nodes), held
    placed = device_schedule_named(schedule)
    chain = [profile.node(name) for name in dict.fromkeys(s.node for s in cost.stages)]
    search = _CutSearch(CostModel(profile, M, "1f1b", NONE), chain, placed, placed.actions(len(chain), M))
    fitting = [c.step_s for bounds in itertools.combinations(range(1, L), placed.num_stages(len(chain)) - 1)
               if search.fits(c := search.cost(bounds))]
    assert fitting and result.step_s <= min(fitting) * 1.01, (result.step_s, sorted(fitting)[:3])
