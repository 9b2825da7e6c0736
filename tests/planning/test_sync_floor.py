"""The pair search's sync floor (SyncModel.first_group_floor): what two pipelines' gradient sync adds
at least to the slower one's step, whatever their cuts and shares. The search prunes pairs by it
before cutting their chains, so it must never exceed what a plan of the pair is priced at, and the
plans it returns must be the plans of the search without it."""

from __future__ import annotations

import itertools
import random

import pytest

from hetlaunch.launcher.planning import replicas as replicas_module
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import plan
from hetlaunch.launcher.planning.sync_cost import SyncModel, plan_step_s
from plan_reference import random_profile

POLICIES = {"none": NONE, "auto": CompressionConfig()}


def _random_cut(rng: random.Random, stages: int, layers: int) -> list[tuple[int, int]]:
    ends = sorted(rng.sample(range(1, layers), stages - 1)) + [layers]
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(4))
def test_the_floor_is_below_the_price_of_any_cut_and_share(seed, policy):
    rng = random.Random(seed)
    profile = random_profile(rng, 6, 3, 12)
    sync, compression = SyncModel(profile), POLICIES[policy]
    M = rng.choice([8, 24, 48])
    nodes = profile.nodes
    tight = 0
    for _ in range(300):
        picked = rng.sample(nodes, rng.randint(2, 6))
        split = rng.randint(1, len(picked) - 1)
        a, b = picked[:split], picked[split:]
        m = rng.randint(1, M - 1)
        costs = []
        for chain, share in ((a, m), (b, M - m)):
            cm = CostModel(profile, share, "1f1b", compression)
            costs.append(cm.exact(chain, cm.evaluate(chain, _random_cut(rng, len(chain), 12))))
        step = plan_step_s(costs, sync.costs(costs, compression))
        slower = max(c.step_s for c in costs)
        floor = sync.first_group_floor(a[0], b[0], compression)
        assert step >= slower + floor, (step, slower, floor)
        tight += floor > 0.25 * (step - slower)
    assert tight >= 15  # a floor that is mostly 0 would prune nothing (and pass anyway)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed,microbatches", list(itertools.product(range(4), (8, 48))))
def test_pruning_by_it_returns_the_plan_of_the_search_without_it(seed, microbatches, policy, monkeypatch):
    profile = random_profile(random.Random(100 + seed), 6, 3, 12)
    kwargs = dict(num_microbatches=microbatches, schedule="1f1b", max_pipelines=6, compression=POLICIES[policy])
    pruned = plan(profile, **kwargs)
    monkeypatch.setattr(replicas_module.Replicas, "sync_floor", lambda self, first, second: 0.0)
    unpruned = plan(profile, **kwargs)
    assert pruned.tokens_per_s == unpruned.tokens_per_s

    def cuts(result):
        return [[(s.node, s.layer_start, s.layer_end, s.window, s.codec) for s in p.cost.stages] for p in result.pipelines]
    assert cuts(pruned) == cuts(unpruned)
