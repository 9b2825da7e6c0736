"""Several data-parallel pipelines: the gradient sync's cost, the codec it gets, and the planner's choice.

The planner is checked against brute force over every pair of disjoint chains, every cut
of each and every micro-batch split, under the same cost model (launcher/planning/cost_model.py
and launcher/planning/sync_cost.py).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from plan_reference import random_profile, regions_profile

from hetlaunch.launcher.planning.compression import CODEC_SLACK, LOSSINESS, NONE, CompressionConfig, wire_ratio
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import plan, price_pipelines
from hetlaunch.launcher.planning.profile_file import LinkProfile, Profile
from hetlaunch.launcher.planning.sync_cost import SYNC_BUCKET_BYTES, allreduce_s, plan_step_s, sync_costs
from hetlaunch.launcher.planning.sync_groups import sync_groups

GiB, MiB = 2**30, 2**20


# -- the sync cost formula -----------------------------------------------------------------------

# Pipeline 0: a0 [0, 2) | a1 [2, 4), 3 micro-batches; pipeline 1: b0 [0, 1) | b1 [1, 4), 5.
PINNED = [(["a0", "a1"], [(0, 2), (2, 4)], 3), (["b0", "b1"], [(0, 1), (1, 4)], 5)]


def pinned_profile(cross_bandwidth: float, cross_latency: float = 0.01) -> Profile:
    profile = regions_profile(num_layers=4, layer_s=0.01, param_bytes=8 * MiB, output_bytes=MiB,
                              cross_bandwidth=cross_bandwidth, cross_latency=cross_latency)
    costs = {"a0": {"int8": 1e-10}, "b0": {"int8": 3e-10}}
    return profile.model_copy(update={"nodes": [n.model_copy(update={"codec_seconds_per_byte": costs.get(n.name)})
                                                for n in profile.nodes]})


def expected_end(profile: Profile, result, group) -> tuple[float, float]:
    """(ready, backward) of a group, written out from the module docstring's formulas."""
    ready, backward = -math.inf, 0.0
    for p, j in group.holders:
        cost = result.pipelines[p].cost
        cm = CostModel(profile, cost.num_microbatches)
        node = profile.node(cost.stages[j].node)
        drain = sum(2 / 3 * s.compute_s + s.latency_s + s.link_s for s in cost.stages[:j])
        below = 2 / 3 * cm.compute_s(node, cost.stages[j].layer_start, group.layer_start)
        ready = max(ready, cost.step_s - drain - below)
        backward = max(backward, 2 / 3 * cm.compute_s(node, group.layer_start, group.layer_end))
    return ready, backward


def test_sync_groups_bytes_links_and_ring_formula():
    profile = pinned_profile(cross_bandwidth=1e8, cross_latency=0.01)
    result = price_pipelines(profile, PINNED)
    assert [p.cost.num_microbatches for p in result.pipelines] == [3, 5]
    groups = sync_groups([cuts for _, cuts, _ in PINNED])
    assert [(g.layer_start, g.layer_end, g.nodes) for g in result.sync] == [
        (0, 1, ("a0", "b0")), (1, 2, ("a0", "b1")), (2, 4, ("a1", "b1"))]
    step = max(p.cost.step_s for p in result.pipelines)
    alone = []
    for g, group in zip(result.sync, groups):
        assert g.bytes == 8 * MiB * (g.layer_end - g.layer_start)
        assert (g.codec, g.bandwidth_bytes_per_s, g.latency_s) == ("none", 1e8, 0.01)
        assert g.allreduce_s == pytest.approx(2 * 1 / 2 * g.bytes / 1e8 + 2 * 1 * 0.01)
        ready, backward = expected_end(profile, result, group)
        buckets = g.bytes // SYNC_BUCKET_BYTES
        alone.append((ready, max(ready + g.allreduce_s / buckets, ready - backward + g.allreduce_s)))
    # a0 holds groups 0 and 1, b1 groups 1 and 2: each node's groups queue on its link, in the
    # order they become ready.
    busy: dict[str, float] = {}
    for k in sorted(range(len(groups)), key=lambda k: alone[k][0]):
        g = result.sync[k]
        start = alone[k][1] - g.allreduce_s
        busy.update({n: max(busy.get(n, start), start) + g.allreduce_s for n in g.nodes})
        assert g.end_s == pytest.approx(max(alone[k][1], *(busy[n] for n in g.nodes)))
        assert g.exposed_s == pytest.approx(max(0.0, g.end_s - step))
    assert any(g.end_s > end + 1e-9 for g, (_, end) in zip(result.sync, alone)), "no group waited for a shared link"
    assert result.step_s == pytest.approx(max(step, max(g.end_s for g in result.sync)))
    assert result.tokens_per_s == pytest.approx(8 * 4 * 64 / result.step_s)


def test_compressed_sync_is_an_all_gather_plus_codec_work_of_the_slowest_holder():
    profile = pinned_profile(cross_bandwidth=1e8, cross_latency=0.01)
    result = price_pipelines(profile, PINNED, compression=CompressionConfig(sync="int8"))
    first = result.sync[0]  # a0 (1e-10 s/byte) and b0 (3e-10 s/byte)
    assert first.codec == "int8"
    assert first.allreduce_s == pytest.approx(1 * 8 * MiB * wire_ratio("int8") / 1e8 + 1 * 0.01 + 8 * MiB * 3e-10)
    assert result.sync[2].allreduce_s == pytest.approx(16 * MiB * wire_ratio("int8") / 1e8 + 0.01)  # no codec cost


def test_three_holders_take_the_slowest_link_and_the_largest_latency():
    profile = regions_profile(per_region=1, regions=("a", "b", "c"), num_layers=2, param_bytes=4 * MiB)
    profile = profile.model_copy(update={"links": [
        *[link for link in profile.links if link.regions[0] == link.regions[1]],
        LinkProfile(regions=("a", "b"), bandwidth_bytes_per_s=3e8, latency_s=0.01),
        LinkProfile(regions=("a", "c"), bandwidth_bytes_per_s=1e8, latency_s=0.002),
        LinkProfile(regions=("b", "c"), bandwidth_bytes_per_s=2e8, latency_s=0.03)]})
    result = price_pipelines(profile, [([name], [(0, 2)], 2) for name in ("a0", "b0", "c0")])
    (g,) = result.sync
    assert (g.nodes, g.bandwidth_bytes_per_s, g.latency_s) == (("a0", "b0", "c0"), 1e8, 0.03)
    assert g.allreduce_s == pytest.approx(2 * 2 / 3 * 8 * MiB / 1e8 + 2 * 2 * 0.03)
    assert allreduce_s(8 * MiB, 3, 1e8, 0.03, "fp16", 1e-9) == pytest.approx(
        2 * 8 * MiB * wire_ratio("fp16") / 1e8 + 2 * 0.03 + 8 * MiB * 1e-9)


def test_sync_hides_behind_backward_on_a_fast_link_and_shows_on_a_slow_one():
    fast = pinned_profile(cross_bandwidth=1e13, cross_latency=0.0)
    result = price_pipelines(fast, PINNED)
    step = max(p.cost.step_s for p in result.pipelines)
    bottom, *upper = result.sync
    assert all(g.exposed_s == 0.0 for g in upper), "groups above stage 0 finish while stage 0 still computes"
    # Stage 0 ends the step: its last bucket is always exposed (8 MiB = two 4 MiB buckets).
    assert bottom.exposed_s == pytest.approx(bottom.allreduce_s / 2)
    assert result.step_s == pytest.approx(step + bottom.allreduce_s / 2) and bottom.allreduce_s < 1e-6

    slow_profile = pinned_profile(cross_bandwidth=1e6)
    slow = price_pipelines(slow_profile, PINNED)
    assert all(g.exposed_s > 0 for g in slow.sync)
    # Stage 0 holds the bottom group: ready at the step's end, its buckets stream during its own
    # backward, but a0's link first carries group 1 (ready earlier): the bottom group queues behind it.
    groups = sync_groups([cuts for _, cuts, _ in PINNED])
    ready, backward = expected_end(slow_profile, slow, groups[0])
    ready1, backward1 = expected_end(slow_profile, slow, groups[1])
    a0, a1 = slow.sync[0].allreduce_s, slow.sync[1].allreduce_s
    a0_free = max(ready1 + a1 / 2, ready1 - backward1 + a1)  # when a0's link has carried group 1
    assert slow.sync[0].end_s == pytest.approx(max(ready - backward + a0, a0_free + a0))
    assert slow.sync[0].end_s > ready - backward + a0
    assert slow.step_s > 8 * MiB / 1e6, "the sync, not compute, sets the step"


def test_one_pipeline_has_no_sync():
    profile = regions_profile()
    assert plan(profile, 8).sync == []
    assert sync_costs(profile, [plan(profile, 8).pipelines[0].cost]) == []


# -- sync codec choice ---------------------------------------------------------------------------

def test_sync_candidates_follow_the_policy():
    assert CompressionConfig().sync_candidates(cross_region=True) == ("none", "fp16", "int8")
    assert CompressionConfig().sync_candidates(cross_region=False) == ("none",)
    assert CompressionConfig(sync="int4").sync_candidates(cross_region=False) == ("int4",)
    assert NONE.sync_candidates(cross_region=True) == ("none",)


def mixed_pinned(profile: Profile):
    # Groups: layers 0-1 on a0 + a1 (in region a), 2-3 on a0 + b1 (across), 4-7 on b0 + b1 (in region b).
    return [(["a0", "b0"], [(0, 4), (4, 8)], 4), (["a1", "b1"], [(0, 2), (2, 8)], 4)]


class CrossRegionAt:
    """A compression policy whose cross-region sync groups take one codec; in-region ones none."""

    sync_topology = "auto"

    def __init__(self, codec: str):
        self.codec = codec

    def sync_candidates(self, cross_region: bool) -> tuple[str, ...]:
        return (self.codec,) if cross_region else ("none",)


def test_auto_compresses_only_cross_region_sync_on_the_critical_path():
    profile = regions_profile(param_bytes=64 * MiB, output_bytes=MiB, cross_bandwidth=1.25e8, cross_latency=0.02,
                              codec_seconds_per_byte={"fp16": 1e-11, "int8": 2e-11})
    result = price_pipelines(profile, mixed_pinned(profile), compression=CompressionConfig())
    codecs = {(g.layer_start, g.layer_end): g.codec for g in result.sync}
    assert codecs[(0, 2)] == "none" and codecs[(4, 8)] == "none", "in-region sync is never compressed under auto"
    assert codecs[(2, 4)] != "none", codecs
    uncompressed = price_pipelines(profile, mixed_pinned(profile), compression=CompressionConfig(sync="none"))
    assert result.step_s < uncompressed.step_s
    # The chosen codec is the least lossy one within CODEC_SLACK of the best choice: the group's
    # end as sync_costs prices it with each codec pinned on it alone (in-region groups as under auto).
    pipelines = [p.cost for p in result.pipelines]
    ends = {c: next(g.end_s for g in sync_costs(profile, pipelines, CrossRegionAt(c)) if g.layer_start == 2)
            for c in ("none", "fp16", "int8")}
    best = max(max(p.step_s for p in pipelines), min(ends.values()))
    assert codecs[(2, 4)] == next(c for c in LOSSINESS if c in ends and ends[c] <= best * (1 + CODEC_SLACK))
    # A pinned codec applies to every group, in a region too.
    pinned = price_pipelines(profile, mixed_pinned(profile), compression=CompressionConfig(sync="fp16"))
    assert {g.codec for g in pinned.sync} == {"fp16"}


def test_auto_leaves_sync_uncompressed_when_it_is_hidden():
    profile = regions_profile(param_bytes=64 * 2**10, output_bytes=MiB, cross_bandwidth=1e10, cross_latency=1e-5)
    result = price_pipelines(profile, mixed_pinned(profile), compression=CompressionConfig())
    assert {g.codec for g in result.sync} == {"none"}


# -- where the replicas go -----------------------------------------------------------------------

def test_two_in_region_pipelines_beat_one_across_a_slow_link():
    # 8 MiB activations over 10 Mbps would take 6.7 s per crossing; 64 KiB of parameters per
    # layer sync across in a fraction of the step.
    profile = regions_profile(param_bytes=64 * 2**10, output_bytes=8 * MiB, cross_bandwidth=1.25e6, cross_latency=0.05)
    result = plan(profile, 16, max_pipelines=2)
    assert len(result.pipelines) == 2
    assert sorted(p.regions for p in result.pipelines) == [("a", "a"), ("b", "b")]
    assert [p.cost.num_microbatches for p in result.pipelines] == [8, 8]
    assert len(result.sync) == 2 and all(g.exposed_s < 0.2 * result.step_s for g in result.sync)
    assert result.step_s < plan(profile, 16).step_s
    # With `auto`, the cross-region sync (on the critical path: stage 0 ends the step) is compressed.
    auto = plan(profile, 16, max_pipelines=2, compression=CompressionConfig())
    assert all(g.codec != "none" for g in auto.sync) and auto.step_s < result.step_s


def test_heavy_parameters_keep_replicas_of_a_layer_in_one_region():
    # 256 MiB of parameters per layer: 1 GiB per group would take 8.6 s across 1 Gbps, while a
    # 1 MiB activation crosses in 8 ms. Each pipeline then spans both regions, and the holders of
    # every layer sit in the same region: sync stays on the fast links.
    profile = regions_profile(param_bytes=256 * MiB, output_bytes=MiB, cross_bandwidth=1.25e8, cross_latency=0.02)
    for policy in (NONE, CompressionConfig()):
        result = plan(profile, 16, max_pipelines=2, compression=policy)
        assert len(result.pipelines) == 2
        assert all(p.regions == ("a", "b") for p in result.pipelines)
        assert all(len({profile.node(n).region for n in g.nodes}) == 1 for g in result.sync)
        assert all(g.codec == "none" for g in result.sync)
        assert result.step_s <= plan(profile, 16, compression=policy).step_s
    # Forced to put the replicas in different regions, the sync would cost seconds.
    split = price_pipelines(profile, [(["a0", "a1"], [(0, 4), (4, 8)], 8), (["b0", "b1"], [(0, 4), (4, 8)], 8)])
    assert split.step_s > result.step_s + 4


# -- against brute force -------------------------------------------------------------------------

def _cuts(k: int, L: int):
    for bounds in itertools.combinations(range(1, L), k - 1):
        edges = (0, *bounds, L)
        yield list(zip(edges, edges[1:]))


def brute_force_two(profile: Profile, M: int, schedule: str, with_sync: bool) -> float:
    """The best plan of one or two pipelines: every chain, cut and split (sync on all cut pairs)."""
    L = profile.model.num_layers
    models = {m: CostModel(profile, m, schedule) for m in range(1, M + 1)}
    chains = [c for k in range(1, min(len(profile.nodes), L) + 1) for c in itertools.permutations(profile.nodes, k)]
    fits = {}  # (chain, m) -> every cut that fits in memory, priced
    for chain in chains:
        for m in range(1, M + 1):
            costs = (models[m].deepen(list(chain), models[m].evaluate(list(chain), cuts)) for cuts in _cuts(len(chain), L))
            fits[tuple(n.name for n in chain), m] = [c for c in costs
                                                     if all(s.memory_bytes <= s.capacity_bytes for s in c.stages)]
    best = min((c.step_s for chain in chains for c in fits[tuple(n.name for n in chain), M]), default=math.inf)
    for a, b in itertools.combinations(chains, 2):
        if {n.name for n in a} & {n.name for n in b}:
            continue
        for m in range(1, M):
            xs, ys = fits[tuple(n.name for n in a), m], fits[tuple(n.name for n in b), M - m]
            if not with_sync:
                if xs and ys:
                    best = min(best, max(min(x.step_s for x in xs), min(y.step_s for y in ys)))
                continue
            for x, y in itertools.product(xs, ys):
                if max(x.step_s, y.step_s) < best:  # the sync only adds
                    best = min(best, plan_step_s([x, y], sync_costs(profile, [x, y])))
    return best


def small_instance(seed: int, free_sync: bool) -> tuple[Profile, int, str]:
    rng = random.Random(seed)
    num_nodes, num_layers = rng.randint(4, 5), rng.randint(4, 6)
    profile = random_profile(rng, num_nodes, rng.randint(1, 2), num_layers)
    if free_sync:
        profile = profile.model_copy(update={"layers": [layer.model_copy(update={"param_bytes": 0})
                                                        for layer in profile.layers]})
    return profile, rng.choice([2, 4, 6]), rng.choice(["1f1b", "gpipe"])


@pytest.mark.parametrize("seed", range(16))
def test_two_pipelines_equal_brute_force_when_sync_is_free(seed):
    profile, M, schedule = small_instance(seed, free_sync=True)
    want = brute_force_two(profile, M, schedule, with_sync=False)
    got = plan(profile, M, schedule, max_pipelines=2)
    assert got.step_s == pytest.approx(want, rel=1e-9)
    assert sum(p.cost.num_microbatches for p in got.pipelines) == M


def test_two_pipelines_near_brute_force_with_sync():
    # Seeds 39 and 75 are 5.7% and 10.3% above (4.9% and 5.3% when plans were priced by the
    # closed form, 6.2% each before a node's sync groups shared its link in the price; both
    # sides price the same way), every other seed here within 0.01%. The planner cuts each
    # chain for its own step and then polishes single boundaries for the sync; a best plan
    # that needs a chain cut worse for its own step, or other chains, is missed (seed 75's best
    # pairs a 2-stage chain with a 3-stage one, where the planner pairs two 2-stage chains).
    ratios = {}
    for seed in [*range(24), 39, 75]:
        profile, M, schedule = small_instance(seed, free_sync=False)
        want = brute_force_two(profile, M, schedule, with_sync=True)
        got = plan(profile, M, schedule, max_pipelines=2)
        assert got.step_s <= plan(profile, M, schedule).step_s * (1 + 1e-12)
        assert got.step_s >= want * (1 - 1e-9), "the brute force is a lower bound"
        ratios[seed] = got.step_s / want
    assert max(ratios.values()) <= 1.11, ratios
    assert sum(r <= 1 + 1e-9 for r in ratios.values()) >= len(ratios) - 3, ratios
