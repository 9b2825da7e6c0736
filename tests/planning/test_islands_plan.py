"""Planning islands: grouping nodes, shares by speed, H, the merged plan and what the YAML refuses."""

from __future__ import annotations

import json
import math

import pytest
from plan_reference import regions_profile

from conftest import run_hetlaunch
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.island_plans import ProfileCluster, plan_islands
from hetlaunch.launcher.planning.islands import (OUTER_SHARE, ExchangeGroup, IslandError, choose_every,
                                                 exchange_seconds, exposed_seconds, island_groups, pipeline_islands)
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.profile_edits import subset
from hetlaunch.launcher.planning.profile_file import save_profile
from hetlaunch.launcher.planning.request import PlanRequest, plan_for
from hetlaunch.launcher.train_config import OuterConfig, TrainConfig

NODES = [("a0", "us"), ("b0", "eu"), ("a1", "us"), ("c0", "ap")]


def test_islands_by_region_in_order_of_first_use_or_as_listed():
    assert island_groups("by_region", NODES) == [["a0", "a1"], ["b0"], ["c0"]]
    assert island_groups([["a0", "b0"], ["a1", "c0", "gone"]], NODES) == [["a0", "b0"], ["a1", "c0"]]
    assert island_groups([["a0"], ["zz"]], NODES) == [["a0"]]  # an island with no node left is dropped


def test_each_pipeline_in_one_island_or_refused_naming_it():
    groups = [["a0", "a1"], ["b0", "c0"]]
    assert pipeline_islands([["b0"], ["a0", "a1"], ["c0"]], groups) == (0, 1, 0)  # numbered by first use
    assert pipeline_islands([["a0"], ["a1"]], groups) == ()  # one island: synchronous
    with pytest.raises(IslandError, match=r"^pipeline 1 \(a1, b0\) spans islands"):
        pipeline_islands([["a0"], ["a1", "b0"]], groups)


def test_every_is_the_smallest_h_whose_exposed_exchange_is_within_five_percent():
    step, exchange = 0.1, 0.35
    every = choose_every(exchange, step, fragments=1, delay=0)
    assert exchange <= OUTER_SHARE * every * step + 1e-12
    assert exchange > OUTER_SHARE * (every - 1) * step
    # Streaming with a delay hides each fragment's share behind the steps it overlaps: only the
    # link's capacity (the whole model once per H steps) and the delay bound H.
    assert exposed_seconds(exchange, step, fragments=4, delay=1) == 0.0
    assert choose_every(exchange, step, fragments=4, delay=1) == max(2, math.ceil(exchange / step))


def test_an_exchange_takes_the_busiest_holders_sum_over_its_slowest_links():
    groups = [ExchangeGroup(4e6, ("a", "b"), 1e6, 0.05), ExchangeGroup(4e6, ("a", "c"), 2e6, 0.0)]
    seconds, sent = exchange_seconds(groups, "none")
    assert seconds == pytest.approx(4e6 / 1e6 + 0.05 + 4e6 / 2e6)  # a is in both
    assert sent == pytest.approx(2 * 4e6 * 2)
    int8, _ = exchange_seconds(groups, "int8")
    assert int8 < 0.3 * seconds


def _offline(every="auto", **outer):
    profile = regions_profile(per_region=2, cross_bandwidth=2.5e6, cross_latency=0.05, output_bytes=2**20,
                              layer_s=0.01)
    train = TrainConfig(num_microbatches=8, micro_batch_size=4, outer=OuterConfig(every=every, **outer))
    request = PlanRequest(num_microbatches=8, schedule="1f1b", compression=CompressionConfig())
    return profile, train, request


def test_a_plan_of_islands_keeps_every_sync_inside_its_region_and_prices_the_outer_exchange():
    profile, train, request = _offline()
    plan = plan_islands(ProfileCluster(profile, train), profile, request)
    regions = {n.name: n.region for n in profile.nodes}
    pipelines = plan.pipelines()
    assert len(set(plan.islands)) == 2 and plan.num_microbatches == 8
    for members in plan.island_members():  # an island's pipelines are one region's nodes
        assert len({regions[s.node] for p in members for s in pipelines[p]}) == 1
    for group in plan.sync_plans():  # every-step sync never crosses a region
        assert len({regions[n] for n in group.nodes}) == 1
    outer_groups = plan.outer_sync_plans()
    assert all(len(g.nodes) == len(pipelines) for g in outer_groups)  # every pipeline's holder meets at the outer step
    # Each island priced alone at its share; the plan's step adds the exposed exchange over H steps.
    islands = [plan_for(subset(profile, [s.node for p in members for s in pipelines[p]]),
                        PlanRequest(num_microbatches=m, schedule="1f1b", compression=CompressionConfig()))
               for members, m in zip(plan.island_members(), plan.island_microbatches())]
    slowest = max(r.step_s for r in islands)
    o = plan.outer
    assert o.every_source == "planned" and o.exposed_s == pytest.approx(o.exchange_s)
    assert plan.predicted_step_s == pytest.approx(slowest + o.exposed_s / o.every)
    assert o.exposed_s / o.every <= OUTER_SHARE * slowest + 1e-12
    # Against the synchronous plan on the same profile: every step waited on the cross-region link.
    synchronous = plan_for(profile, request)
    assert plan.predicted_tokens_per_s > 1.5 * synchronous.tokens_per_s


def test_unequal_islands_get_micro_batches_by_speed():
    profile, train, request = _offline()
    slow = {n.name: n.model_copy(update={"layer_seconds": [t * 3 for t in n.layer_seconds]}) for n in profile.nodes
            if n.region == "b"}
    profile = profile.model_copy(update={"nodes": [slow.get(n.name, n) for n in profile.nodes]})
    plan = plan_islands(ProfileCluster(profile, train), profile, request)
    fast, slow_share = plan.island_microbatches()
    assert fast > slow_share >= 1


def test_a_pinned_every_is_kept_and_one_region_is_a_plain_synchronous_plan():
    profile, train, request = _offline(every=7)
    plan = plan_islands(ProfileCluster(profile, train), profile, request)
    assert plan.outer.every == 7 and plan.outer.every_source == "pinned"
    one_region = subset(profile, ["a0", "a1"])
    plain = plan_islands(ProfileCluster(one_region, train), one_region, request)
    assert plain.islands == () and plain.outer is None


def test_plan_offline_with_islands_as_json(tmp_path):
    profile, _, _ = _offline()
    save_profile(profile, tmp_path / "p.json")
    result = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--islands", "--microbatches", "8",
                           "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert sorted(set(plan["islands"])) == [0, 1] and plan["outer"]["every"] >= 1
    table = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--islands", "--outer-every", "10",
                          "--microbatches", "8", timeout=60)
    assert table.returncode == 0, table.stderr
    assert "island 1:" in table.stdout and "outer step every 10 steps (as given: train.outer.every or --outer-every)" in table.stdout


@pytest.mark.parametrize("args, message", [
    (["--global-batch", "65537"], "--global-batch 65537: global_batch: 65537 samples at micro_batch_size"),
    (["--outer-every", str(10**12)], "hetlaunch plan: Invalid value for '--outer-every'"),
])
def test_plan_offline_with_islands_refuses_a_batch_or_period_past_the_bounds_in_one_line(tmp_path, args, message):
    """A global batch of more micro-batches than a step may have was a pydantic traceback; an outer
    period of 10^12 was planned (a hostile review)."""
    profile, _, _ = _offline()
    save_profile(profile, tmp_path / "p.json")
    result = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--islands", *args, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


@pytest.mark.parametrize("args, message", [
    (["--schedule", "zb-v"], "--schedule zb-v: islands are not supported with it"),
    (["--schedule", "interleaved-1f1b"], "--schedule interleaved-1f1b: islands are not supported with it"),
    (["--global-batch", "48"], "--global-batch: with islands the YAML's batch is planned, as `up` runs it"),
    (["--global-batch", "7", "--microbatches", "3"], "--global-batch, --microbatches: with islands the YAML's"),
])
def test_plan_refuses_what_an_islands_plan_would_not_honour(tmp_path, args, message):
    """`hetlaunch plan` of a YAML with train.outer printed a ZB-V islands plan (validate and up refuse
    it) and planned the YAML's batch where --global-batch asked for another, exit 0 (a hostile review)."""
    (tmp_path / "c.yaml").write_text("nodes: [{name: a, region: r0}, {name: b, region: r1}]\n"
                                     "train: {outer: {every: 10}}\n")
    result = run_hetlaunch("plan", str(tmp_path / "c.yaml"), "--profile", str(tmp_path / "none.json"), *args,
                           timeout=60)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), result.stderr
    if "--schedule" in args:  # offline, without a YAML, alike
        result = run_hetlaunch("plan", "--profile", str(tmp_path / "none.json"), "--islands", *args, timeout=60)
        assert result.returncode == 2 and result.stderr.startswith(f"error: {message}"), result.stderr


@pytest.mark.parametrize("outer, message", [
    ("{islands: [[a], [a, b]]}", r"train\.outer\.islands\[1\]: node 'a' is in two islands"),
    ("{islands: [[a], [zz]]}", r"train\.outer\.islands\[1\]: node 'zz' is not in nodes"),
    ("{islands: [[a]]}", r"train\.outer\.islands: node\(s\) b are in no island"),
    ("{every: 4, delay: 4}", r"train\.outer\.delay: 4 must be below every \(4\)"),
    ("{every: 0}", r"train\.outer\.every"),
    ("{codec: int3}", r"train\.outer\.codec"),
    ("{alpha: 0.5}", r"train\.outer\.alpha: mixes the local weights .* only with a delay"),
    ("{fragments: 7}", r"train\.outer\.fragments: 7 fragments of a model of 6 stage layers"),
])
def test_bad_outer_sections_are_refused_naming_the_field(outer, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster(f"nodes: [{{name: a}}, {{name: b}}]\ntrain: {{outer: {outer}}}\n")


def test_a_pinned_pipeline_across_two_islands_is_refused():
    text = ("nodes: [{name: a, region: us, layers: [0, 4]}, {name: b, region: eu, layers: [4, 8]}]\n"
            "model: {preset: tiny, n_layers: 6}\ntrain: {outer: {islands: by_region}}\n")
    with pytest.raises(ConfigError, match=r"train\.outer\.islands: pipeline 0 \(a, b\) spans islands"):
        parse_cluster(text)


def test_validate_says_what_the_islands_are(tmp_path):
    (tmp_path / "c.yaml").write_text("nodes: [{name: a, region: us}, {name: b, region: eu}, {name: c, region: us}]\n"
                                     "train: {outer: {every: 30}}\n")
    result = run_hetlaunch("validate", str(tmp_path / "c.yaml"), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "train.outer: 2 islands (one per region): [a, c]; [b]" in result.stdout
    assert "outer steps every 30 steps, int8 deltas" in result.stdout
    (tmp_path / "one.yaml").write_text("nodes: [{name: a}, {name: b}]\ntrain: {outer: {}}\n")
    one = run_hetlaunch("validate", str(tmp_path / "one.yaml"), timeout=60)
    assert one.returncode == 0 and "form one island (one per region), so training is synchronous" in one.stdout


def test_h_never_exceeds_the_run_and_a_stalled_outer_step_is_not_a_stall():
    from hetlaunch.launcher.stage_launch import OUTER_WAIT_FACTOR, OUTER_WAIT_MIN_S, _outer_wait_s, watchdog_bounds

    profile, train, request = _offline()
    slow = profile.model_copy(update={"links": [link.model_copy(update={"bandwidth_bytes_per_s": 1e3})
                                                if link.regions[0] != link.regions[1] else link
                                                for link in profile.links]})
    train = train.model_copy(update={"steps": 40})
    plan = plan_islands(ProfileCluster(slow, train), slow, request)
    assert plan.outer.every == 40  # the exchange alone would ask for far more: an outer step must happen
    wait = _outer_wait_s(plan)
    assert wait == max(OUTER_WAIT_MIN_S, OUTER_WAIT_FACTOR * plan.outer.exchange_s) > 60
    auto = watchdog_bounds("auto", plan.predicted_step_s, wait)["watchdog_s"]
    assert auto == max(10 * plan.predicted_step_s, 60.0) + wait  # the stage waits on the exchange without a step


def test_too_few_micro_batches_for_the_islands_is_a_planning_error():
    from hetlaunch.launcher.planning.planning_error import PlanningError

    profile, train, request = _offline()
    three = regions_profile(per_region=1, regions=("a", "b", "c"), cross_bandwidth=2.5e6, output_bytes=2**20)
    with pytest.raises(PlanningError, match=r"^2 micro-batches a step cannot feed 3 islands"):
        plan_islands(ProfileCluster(three, train), three, PlanRequest(num_microbatches=2, schedule="1f1b",
                                                                     compression=CompressionConfig()))


def test_a_stage_of_islands_is_priced_with_its_anchor_momentum_and_error_buffers():
    from hetlaunch.launcher.planning.planner import price_pipelines

    profile, train, request = _offline()
    plan = plan_islands(ProfileCluster(profile, train), profile, request)
    stage = plan.stages[0]
    nodes = [s.node for s in plan.pipelines()[0]]
    plain = price_pipelines(subset(profile, nodes), [(nodes, [(s.layer_start, s.layer_end) for s in plan.pipelines()[0]],
                                                      plan.pipeline_microbatches[0])])
    params = sum(profile.layers[i].param_bytes for i in range(stage.layer_start, stage.layer_end))
    extra = stage.memory_bytes - plain.pipelines[0].cost.stages[0].memory_bytes
    assert extra >= 3 * params  # fp32 anchor + outer momentum + int8 error feedback, at least


def test_more_fragments_than_a_profiled_model_has_layers_is_refused_at_planning():
    """validate checks fragments against the YAML's layers; a model of its own entrypoint has none
    there, and 40 fragments of a 4-layer model ran 10 empty exchanges a step (a hostile review)."""
    profile, _, request = _offline()
    layers = profile.model.num_layers
    train = TrainConfig(num_microbatches=8, micro_batch_size=4, outer=OuterConfig(every=4, fragments=layers + 1))
    with pytest.raises(PlanningError, match=rf"train\.outer\.fragments: {layers + 1} fragments of a model of "
                                            rf"{layers} stage layers"):
        plan_islands(ProfileCluster(profile, train), profile, request)


def test_an_every_capped_by_the_runs_steps_says_so():
    """`every: auto` is capped at train.steps (the islands must meet once); the plan said it was the
    smallest H whose exposed exchange is within 5%, which it then is not (a hostile review)."""
    profile, train, request = _offline()
    chosen = plan_islands(ProfileCluster(profile, train), profile, request).outer
    assert chosen.every_source == "planned" and chosen.every > 1
    short = train.model_copy(update={"steps": chosen.every - 1})
    capped = plan_islands(ProfileCluster(profile, short), profile, request).outer
    assert (capped.every, capped.every_source) == (chosen.every - 1, "capped")


def test_more_fragments_than_pinned_layers_of_an_entrypoint_model_is_refused_at_validate():
    """A model of its own entrypoint has no depth in the YAML, but pins that tile it do: 40 fragments
    of 4 pinned layers passed validate and ran (a review of the planning-time check)."""
    with pytest.raises(ConfigError, match=r"train\.outer\.fragments: 40 fragments of a model of 4 stage layers"):
        parse_cluster('model: {entrypoint: "user_model:make_mlp_lm", kwargs: {n_hidden: 2, seq_len: 16}}\n'
                      "train: {outer: {every: 2, fragments: 40}}\n"
                      "nodes: [{name: a, region: r0, pipeline: 0, layers: [0, 4]},"
                      " {name: b, region: r1, pipeline: 1, layers: [0, 4]}]\n")
