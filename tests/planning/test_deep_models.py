"""Deep models plan without costs that grow with the square of the layers: the floor program sweeps
the ends with a heap where it visited every (start, end) pair, and sync groups are found per stage
start where every layer was walked. Each is held here to the definition it replaced, written out
plainly: the same answers on random inputs (with coarse values, so that limits land exactly on
prefix sums and stage starts coincide), and the same plans."""

from __future__ import annotations

import math
import random
from pathlib import Path

from hetlaunch.launcher.planning import chain_bounds
from hetlaunch.launcher.planning.chain_bounds import floors_program_python, shared_work_floor
from hetlaunch.launcher.planning.compression import NONE
from hetlaunch.launcher.planning.planner import plan
from hetlaunch.launcher.planning.sync_groups import SyncGroup, sync_groups
from plan_reference import prefix_sums, random_floor_args, random_profile


def _floors_by_every_pair(layers, memory, capacities, optimizer, hops, M, limit, g, h) -> bool:
    """The floor program as first written (chain_bounds.py's docstring): for every stage, every
    start reached and every end after it until the stage's term or memory goes over, the least A."""
    S, L = len(layers), len(optimizer) - 1
    states = {0: 0.0}
    for j in range(S):
        acc, mem = layers[j], memory[j]
        last = L if j == S - 1 else L - (S - 1 - j)
        grown: dict[int, float] = {}
        for start, a in states.items():
            for end in range(start + 1, last + 1):
                work = acc[end] - acc[start]
                term = a + M * work + (optimizer[end] - optimizer[start] if j == 0 else 0.0)
                if term > limit or mem[end] - mem[start] > capacities[j]:
                    break
                if j == S - 1 and end < L:
                    continue
                nxt = a + work / 3 + g * work + ((1 + h) * hops[j] if j < S - 1 else 0.0)
                grown[end] = min(nxt, grown.get(end, math.inf))
        if not grown:
            return False
        states = grown
    return L in states


def test_the_floor_programs_sweep_answers_as_every_pair_does():
    rng, yes, compiled = random.Random(11), 0, 0
    for case in range(6000):
        args = random_floor_args(rng, coarse=case % 2 == 0, max_layers=40)
        want = _floors_by_every_pair(*args)
        assert floors_program_python(*args) is want, args
        if chain_bounds.COMPILED:
            assert chain_bounds._floors.floors_under(*args) is want, args
            compiled += 1
        yes += want
    assert 1000 < yes < 5000  # both answers are exercised
    assert compiled == 6000 or not chain_bounds.COMPILED


def test_where_fewer_micro_batches_than_work_per_layer_let_a_dropped_start_reach_further_the_heap_decides():
    # The compiled sweep keeps a queue that drops a start once a later one has a lower key, exact
    # while M >= 1/3 + g; below (not a plan's M, which is a count), it sweeps the stage again with
    # the heap. The same answers as the definition either way.
    rng, yes = random.Random(12), 0
    for case in range(3000):
        times, memory, capacities, optimizer, hops, _, limit, _, h = random_floor_args(rng, coarse=case % 2 == 0)
        args = (times, memory, capacities, optimizer, hops, 0.25, limit / 4, 2 / 3, h)
        want = _floors_by_every_pair(*args)
        assert floors_program_python(*args) is want, args
        if chain_bounds.COMPILED:
            assert chain_bounds._floors.floors_under(*args) is want, args
        yes += want
    assert 300 < yes < 2700


def test_a_floor_at_a_limit_on_a_stage_term_is_still_under_it():
    # Two stages of 2 and 2 layers at 1 s each, M = 4: the stage terms are 8 (first) and 8 + A.
    layers = [prefix_sums([1.0] * 4)] * 2
    memory = [prefix_sums([0.0] * 4)] * 2
    args = (layers, memory, [1, 1], prefix_sums([0.0] * 4), [0.0], 4)
    a_after_first = 2 / 3 + 2 / 3 * 2  # work / 3 + g work for two layers, g = 2/3, no hop
    for limit, want in ((8 + a_after_first, True), (math.nextafter(8 + a_after_first, 0), False)):
        assert _floors_by_every_pair(*args, limit, 2 / 3, 1.0) is want
        assert floors_program_python(*args, limit, 2 / 3, 1.0) is want
        if chain_bounds.COMPILED:
            assert chain_bounds._floors.floors_under(*args, limit, 2 / 3, 1.0) is want


def _groups_by_every_layer(cuts: list[list[tuple[int, int]]]) -> list[SyncGroup]:
    """Sync groups as first written: walk every layer, start a group where the holders change."""
    groups: list[SyncGroup] = []
    position = [0] * len(cuts)
    for layer in range(cuts[0][-1][1]):
        for p, ranges in enumerate(cuts):
            while ranges[position[p]][1] <= layer:
                position[p] += 1
        holders = tuple(enumerate(position))
        if groups and groups[-1].holders == holders:
            groups[-1] = SyncGroup(groups[-1].layer_start, layer + 1, holders)
        else:
            groups.append(SyncGroup(layer, layer + 1, holders))
    return groups


def test_sync_groups_per_stage_start_are_the_groups_of_every_layer():
    rng = random.Random(5)
    for _ in range(3000):
        L, P = rng.randint(1, 30), rng.randint(2, 5)
        cuts = []
        for _ in range(P):
            # stage starts drawn from few values so that pipelines share boundaries; empty stages too
            inner = sorted(rng.choice([rng.randint(0, L), L // 2, L // 3]) for _ in range(rng.randint(0, 5)))
            bounds = [0] + inner + [L]
            cuts.append(list(zip(bounds, bounds[1:])))
        assert sync_groups(cuts) == _groups_by_every_layer(cuts), cuts


def test_shared_work_floor_is_the_least_time_of_each_layer_summed_in_order():
    rng = random.Random(2)
    for _ in range(2000):
        L, S = rng.randint(0, 40), rng.randint(1, 7)
        layers = [prefix_sums([rng.choice([0.25, 0.5, rng.uniform(0, 2)]) for _ in range(L)]) for _ in range(S)]
        total = 0.0
        for i in range(L):
            total += min(acc[i + 1] - acc[i] for acc in layers)
        steps = [[acc[i + 1] - acc[i] for i in range(L)] for acc in layers]
        assert shared_work_floor(steps) == total / S * (1 - chain_bounds.SLACK)


def test_plans_with_the_floor_program_as_first_written_are_the_same_plans(monkeypatch):
    # 5 nodes and 30 layers at M = 8: chains priced by simulation, so the floor program rules them out
    profiles = [random_profile(random.Random(seed), 5, 2, 30) for seed in range(3)]

    def planned():
        return [(r.tokens_per_s, [p.cost for p in r.pipelines])
                for r in (plan(p, num_microbatches=8, schedule="1f1b", max_pipelines=2, compression=NONE)
                          for p in profiles)]

    swept = planned()
    monkeypatch.setattr(chain_bounds, "floors_program", _floors_by_every_pair)
    assert planned() == swept


def test_the_polish_of_a_deep_model_ends_where_no_boundary_move_pays_and_prices_few_sets_per_move(monkeypatch):
    from hetlaunch.launcher.planning.replicas import Replicas

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from planning_time import deep_profile  # the bench's deep case: 10 nodes in 10 regions, 1,000 layers

    replicas = Replicas(deep_profile(10, 1000), 400, "1f1b", NONE, None)
    priced, moved = 0, 0
    with_cut = Replicas._with_cut

    def counted(self, *args):
        nonlocal priced, moved
        found = with_cut(self, *args)
        priced, moved = priced + 1, moved + (found is not None)
        return found

    monkeypatch.setattr(Replicas, "_with_cut", counted)
    best = replicas.best_set(2)
    assert moved > 100  # boundaries travel far on 1,000 layers: what this test is about
    boundaries = sum(len(p.stages) - 1 for p in best.pipelines)
    # each move, plus one refusal per boundary and direction per pass (a pass over every boundary
    # per move priced about five sets per move)
    assert priced < moved + 2 * boundaries * 4
    monkeypatch.setattr(Replicas, "_with_cut", with_cut)
    for i, pipeline in enumerate(best.pipelines):
        chain = [replicas.profile.node(s.node) for s in pipeline.stages]
        for j in range(len(chain) - 1):
            for delta in (-1, 1):
                cuts = [[s.layer_start, s.layer_end] for s in pipeline.stages]
                cuts[j][1] += delta
                cuts[j + 1][0] += delta
                if cuts[j][1] > cuts[j][0] and cuts[j + 1][1] > cuts[j + 1][0]:
                    assert replicas._with_cut(best, i, chain, cuts) is None
