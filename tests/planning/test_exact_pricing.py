"""Plans are priced by an event simulation of the schedule the executor runs, with links that
carry one message after another in each direction and add their latency (runtime/schedules.py)."""

from __future__ import annotations

import random

import pytest

from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import plan_fixed_cut
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile
from hetlaunch.runtime.schedules import gpipe, one_f_one_b, schedule_for, simulate


def test_one_microbatch_down_and_back_with_the_optimizer_after():
    # F0 [0,1] -> wire 0.5 + latency 0.25 -> F1 [1.75,2.75] -> B1 [2.75,4.75] -> back at 5.5 -> B0 [5.5,7.5] + opt 0.1
    per_stage = [one_f_one_b(s, 2, 1) for s in range(2)]
    assert simulate(per_stage, [1, 1], [2, 2], [0.5], [0.25], [0.1, 0.2]) == pytest.approx(7.6)


def test_messages_queue_on_the_wire_one_direction_at_a_time():
    # GPipe, 2 stages, M=2, a 5 s wire: the second activation waits for the first to leave it.
    per_stage = [gpipe(s, 2, 2) for s in range(2)]
    assert simulate(per_stage, [1, 1], [2, 2], [5.0], [0.0]) == pytest.approx(26.0)


def test_free_links_are_the_old_simulation():
    per_stage = [one_f_one_b(s, 4, 6) for s in range(4)]
    assert simulate(per_stage, [1, 2, 1, 1], [2, 4, 2, 2]) == simulate(per_stage, [1, 2, 1, 1], [2, 4, 2, 2],
                                                                          [0, 0, 0], [0, 0, 0], [0, 0, 0, 0])


def _chain_profile(rng: random.Random, stages: int, first_last_slow: bool) -> Profile:
    """One layer per node, in a chain of regions; each link its own bandwidth and latency."""
    layers = [LayerInfo(param_bytes=2**20, activation_bytes=2**20, output_bytes=2**20) for _ in range(stages)]
    nodes = [NodeProfile(name=f"n{i}", region=f"r{i}", device="dev", memory_bytes=2**40,
                         layer_seconds=[rng.uniform(0.001, 0.050)] * stages, optimizer_seconds=[0.0] * stages)
             for i in range(stages)]
    links = []
    for i in range(stages - 1):
        wire_s = rng.uniform(0.0, 0.100)
        if first_last_slow and i in (0, stages - 2):
            wire_s = rng.uniform(0.080, 0.100)
        links.append(LinkProfile(regions=(f"r{i}", f"r{i + 1}"), bandwidth_bytes_per_s=2**20 / max(wire_s, 1e-6),
                                 latency_s=rng.uniform(0.0, 0.150)))
    return Profile(model=ModelIdentity(description="chain", num_layers=stages), micro_batch_size=1, seq_len=1,
                   layers=layers, nodes=nodes, links=links)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_plans_step_is_the_simulation_of_its_stages_on_200_random_chains(schedule):
    rng = random.Random(14)  # the same 200 chains for both schedules
    worst_closed_form, deepened = 0.0, 0
    for case in range(200):
        stages = rng.randint(2, 6)
        microbatches = rng.choice([1, 2, stages - 1, stages, 4, 8, 16]) or 1  # M < S included
        profile = _chain_profile(rng, stages, first_last_slow=case % 4 == 0)
        result = plan_fixed_cut(profile, [n.name for n in profile.nodes], [(i, i + 1) for i in range(stages)],
                                microbatches, schedule)
        cost = result.pipelines[0].cost
        compute = [s.compute_s for s in cost.stages]
        want = simulate([schedule_for(schedule, j, stages, microbatches, s.window) for j, s in enumerate(cost.stages)],
                        [t / 3 for t in compute], [2 * t / 3 for t in compute],
                        [s.link_s for s in cost.stages[:-1]], [s.latency_s for s in cost.stages[:-1]])
        assert result.step_s == pytest.approx(want, rel=1e-9), (case, stages, microbatches)
        deepened += any(s.window for s in cost.stages)
        if not any(s.window for s in cost.stages):  # the closed form knows 1F1B's own windows only
            closed = CostModel(profile, microbatches, schedule).evaluate(profile.nodes,
                                                                         [(i, i + 1) for i in range(stages)])
            worst_closed_form = max(worst_closed_form, abs(closed.step_s / want - 1))
    if schedule == "gpipe":  # an independent check of the simulation: GPipe's closed form is exact
        assert worst_closed_form < 1e-9 and not deepened
    else:  # 1F1B's is not (its window term), which is why plans are priced by simulation
        assert worst_closed_form > 0.05, worst_closed_form
        assert deepened >= 20, deepened  # distant links: deeper windows were chosen and priced too


def _distant_pair(memory_bytes: float) -> Profile:
    layers = [LayerInfo(param_bytes=2**20, activation_bytes=2**20, output_bytes=2**16) for _ in range(2)]
    nodes = [NodeProfile(name=f"n{i}", region=f"r{i}", device="dev", memory_bytes=memory_bytes,
                         layer_seconds=[0.010, 0.010], optimizer_seconds=[0.0, 0.0]) for i in range(2)]
    links = [LinkProfile(regions=("r0", "r1"), bandwidth_bytes_per_s=1e9, latency_s=0.100)]
    return Profile(model=ModelIdentity(description="pair", num_layers=2), micro_batch_size=1, seq_len=1,
                   layers=layers, nodes=nodes, links=links)


def test_the_planner_deepens_windows_over_a_distant_link_as_far_as_memory_allows():
    roomy = plan_fixed_cut(_distant_pair(2**30), ["n0", "n1"], [(0, 1), (1, 2)], 8)
    stages = roomy.pipelines[0].cost.stages
    assert stages[0].window == 8 and stages[1].window == 0  # all 8 in flight; the last stage's own is deepest
    plain = simulate([schedule_for("1f1b", j, 2, 8) for j in range(2)], [0.01 / 3] * 2, [0.02 / 3] * 2,
                     [stages[0].link_s], [0.1])
    assert roomy.step_s < 0.6 * plain
    # Parameters, gradients and AdamW state take 4 MiB; room for 3 micro-batches of 1 MiB activations more.
    tight = plan_fixed_cut(_distant_pair(7.5 * 2**20), ["n0", "n1"], [(0, 1), (1, 2)], 8)
    first = tight.pipelines[0].cost.stages[0]
    assert first.window == 3 and first.memory_bytes <= first.capacity_bytes


@pytest.mark.parametrize("independent", [True, False], ids=["python", "compiled"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_a_pipeline_whose_report_is_not_its_simulation_is_refused_as_a_planner_bug(schedule, independent,
                                                                                  monkeypatch):
    """check_priced simulates the schedule's lists afresh (Python's simulation of the actions, or
    for long forward-and-backward schedules the compiled sweep): a step or a stage's cost that does
    not match what it reports is caught either way."""
    from dataclasses import replace

    from plan_reference import random_profile

    from hetlaunch.launcher.planning.planner import PlanInvariantError, check_priced, plan

    from hetlaunch.launcher.planning import planner

    if not independent:  # as for long schedules
        monkeypatch.setattr(planner, "INDEPENDENT_CHECK_ACTIONS", 0)
    result = plan(random_profile(random.Random(2), 4, 2, 8), num_microbatches=8, schedule=schedule)
    cost = max((p.cost for p in result.pipelines), key=lambda c: len(c.stages))
    assert len(cost.stages) >= 2
    check_priced(schedule, cost)  # what the planner returned passes
    with pytest.raises(PlanInvariantError, match="simulate to"):
        check_priced(schedule, replace(cost, step_s=cost.step_s * 0.9))
    slower = replace(cost.stages[0], forward_s=cost.stages[0].forward_s * 3)
    with pytest.raises(PlanInvariantError, match="simulate to"):
        check_priced(schedule, replace(cost, stages=(slower, *cost.stages[1:])))
    with pytest.raises(PlanInvariantError):
        check_priced(schedule, replace(cost, exact=False))  # a closed-form figure is not a plan's


def test_stages_the_cost_model_makes_without_init_are_the_stages_init_makes():
    """CostModel.evaluate and with_windows build StageCost without its frozen __init__ (a tenth of
    planning): what they make must equal, hash and print like StageCost(...), stay frozen, and
    refuse a missing or unknown field."""
    import dataclasses

    from hetlaunch.launcher.planning.pipeline_cost import StageCost, copied_stage, made_stage

    values = dict(node="n1", layer_start=2, layer_end=5, compute_s=0.5, link_s=0.1, latency_s=0.02,
                  memory_bytes=3e9, capacity_bytes=8 * 2**30, codec="int8", link_uncompressed_s=0.4, window=3,
                  forward_s=0.15, backward_s=0.3, optimizer_s=0.01, input_grad_s=0.0, weight_grad_s=0.0)
    made, built = made_stage(**values), StageCost(**values)
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert dataclasses.asdict(made) == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.window = 4
    assert copied_stage(made, window=0, memory_bytes=1.0) == dataclasses.replace(built, window=0, memory_bytes=1.0)
    with pytest.raises(TypeError):
        made_stage(**{k: v for k, v in values.items() if k != "codec"})
    with pytest.raises(TypeError):
        made_stage(**values, colour="red")
    # and a plan's stages are those: a whole evaluate compared field by field with StageCost(...)
    from plan_reference import random_profile

    profile = random_profile(random.Random(3), 4, 2, 8)
    cm = CostModel(profile, 4, "1f1b")
    cost = cm.evaluate(profile.nodes[:3], [(0, 3), (3, 5), (5, 8)], ["none", "none"])
    assert all(stage == StageCost(**dataclasses.asdict(stage)) for stage in cost.stages)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_closed_form_step_alone_is_the_evaluated_step(schedule):
    """The chain search ranks long chains by CostModel.closed_form_step without building their
    stages; it must be evaluate's step to the bit, so that which chain wins does not change."""
    from plan_reference import random_profile

    from hetlaunch.launcher.planning.compression import NONE, CompressionConfig

    rng, limited = random.Random(6), 0
    for case in range(300):
        profile = random_profile(random.Random(case), 6, 3, 12)
        cm = CostModel(profile, rng.choice([1, 2, 8, 64]), schedule, rng.choice([CompressionConfig(), NONE]))
        S = rng.randint(1, 6)
        chain = rng.sample(profile.nodes, S)
        edges = [0, *sorted(rng.sample(range(1, cm.num_layers), S - 1)), cm.num_layers]
        cuts = list(zip(edges, edges[1:]))
        codecs = [rng.choice(cm.codec_options(j, a, b)) for j, (a, b) in enumerate(zip(chain, chain[1:]))]
        cost = cm.evaluate(chain, cuts, codecs)
        assert cm.closed_form_step(chain, cuts, codecs).hex() == cost.step_s.hex()
        limited += "window" in cost.bottleneck
    assert schedule == "gpipe" or limited > 10  # the window term is exercised, not only compute and links


def test_links_between_nodes_a_link_names_are_not_taken_from_their_regions_link():
    """CostModel.link looks a regions' link up once per pair of regions: a node-pair link must still
    win for its two nodes, whatever pair was asked first, and only for them."""
    from plan_reference import uniform_profile

    from hetlaunch.launcher.planning.profile_file import LinkProfile

    base = uniform_profile([1, 1, 1, 1], ["a", "a", "b", "b"], cross_bandwidth=1e9, cross_latency=0.01)
    profile = base.model_copy(update={"links": [*base.links, LinkProfile(nodes=("n0", "n2"),
                                                                         bandwidth_bytes_per_s=5e7, latency_s=0.2)]})
    n0, n1, n2, n3 = profile.nodes
    for order in ([(n1, n3), (n0, n2), (n0, n3), (n2, n0)], [(n0, n2), (n1, n3), (n2, n0), (n0, n3)]):
        cm = CostModel(profile, 4)
        got = {(a.name, b.name): cm.link(a, b) for a, b in order}
        assert got[("n0", "n2")] == got[("n2", "n0")] == (5e7, 0.2)
        assert got[("n1", "n3")] == got[("n0", "n3")] == (1e9, 0.01)
        assert all(link == (lambda found: (found.bandwidth_bytes_per_s, found.latency_s))(profile.link(a, b))
                   for (a, b), link in zip(order, got.values()))
