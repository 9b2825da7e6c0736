"""Deep models plan without costs that grow with the square of the layers: the floor program sweeps
the ends with a heap where it visited every (start, end) pair, and sync groups are found per stage
start where every layer was walked. Each is held here to the definition it replaced, written out
plainly: the same answers on random inputs (with coarse values, so that limits land exactly on
prefix sums and stage starts coincide), and the same plans."""

from __future__ import annotations

import math
import random
import struct
import sys

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


def _least_limit(program, args: tuple) -> float | None:
    """The least limit (a float, to the last bit) at which the program says some cut fits; None if none."""
    def says(bits: int) -> bool:
        return program(*args[:6], struct.unpack("<d", struct.pack("<q", bits))[0], *args[7:])

    low, high = 0, struct.unpack("<q", struct.pack("<d", sys.float_info.max))[0]
    if not says(high):
        return None
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if says(mid) else (mid, high)
    return struct.unpack("<d", struct.pack("<q", high))[0]


def test_the_compiled_floor_program_answers_as_python_does_at_the_limits_where_the_answer_turns():
    # Ties decide which start the sweep picks, and the pick shows only at the limit where the answer
    # turns: C and Python must agree there to the last bit, and one step below it.
    rng, turned = random.Random(13), 0
    for case in range(600):
        args = random_floor_args(rng, coarse=case % 3 == 1, max_layers=16)
        if case % 3 == 2:  # every layer alike on every node, at a time binary cannot hold: ties that round
            L, S = len(args[0][0]) - 1, len(args[0])
            times = [prefix_sums([rng.choice([0.1, 1 / 3])] * L)] * S
            args = (times, *args[1:6], None, *args[7:])
        least = _least_limit(floors_program_python, args)
        if least is None or not chain_bounds.COMPILED:
            continue
        turned += 1
        for limit in (least, math.nextafter(least, 0.0)):
            call = (*args[:6], limit, *args[7:])
            assert chain_bounds._floors.floors_under(*call) is floors_program_python(*call), call
    assert turned > 250 or not chain_bounds.COMPILED


def test_a_node_slow_on_layers_before_its_stage_does_not_make_the_floor_rule_out_a_chain_that_fits():
    # The review's case: the middle node takes a day on the first k layers (a profile's most) and
    # nanoseconds on the rest, so the sweep's key is rounded at a day's scale while the stage's A is
    # nanoseconds. The program must still say yes at the definition's least limit plus SLACK (what
    # floors_under gives a chain whose floor is under the bound), and C as Python.
    rng = random.Random(14)
    for _ in range(120):
        L, k = 24, rng.randint(4, 14)
        small = [rng.uniform(1e-9, 2e-9) for _ in range(L)]
        times = [prefix_sums(small), prefix_sums([86400.0] * k + small[k:]),
                 prefix_sums([rng.uniform(1e-9, 2e-9) * rng.choice([0.5, 1, 2, 4]) for _ in range(L)])]
        g, h = rng.choice([(0.0, 0.0), (2 / 3, 1.0)])
        args = (times, [prefix_sums([0.0] * L)] * 3, [1] * 3, prefix_sums([0.0] * L), [0.0, 0.0],
                rng.choice([1, 2, 4]), None, g, h)
        least = _least_limit(_floors_by_every_pair, args)
        call = (*args[:6], least * (1 + chain_bounds.SLACK), g, h)
        assert floors_program_python(*call), call
        if chain_bounds.COMPILED:
            assert chain_bounds._floors.floors_under(*call), call


def test_the_compiled_floor_program_reads_the_slack_and_key_error_of_chain_bounds():
    if chain_bounds.COMPILED:
        assert (chain_bounds._floors.SLACK, chain_bounds._floors.KEY_ERROR) == (chain_bounds.SLACK, chain_bounds.KEY_ERROR)


def test_layer_steps_are_differences_of_the_prefix_sums_not_the_profiles_times():
    from hetlaunch.launcher.planning.cost_model import CostModel

    profile = random_profile(random.Random(3), 2, 1, 3)
    node = profile.nodes[0].model_copy(update={"layer_seconds": [0.1, 0.2, 0.3]})
    profile = profile.model_copy(update={"nodes": [node, profile.nodes[1]]})
    cm = CostModel(profile, 4)
    acc = cm.layer_prefix(node)
    assert cm.layer_steps(node) == [acc[1] - acc[0], acc[2] - acc[1], acc[3] - acc[2]]
    assert cm.layer_steps(node) != [0.1, 0.2, 0.3]  # 0.1 + 0.2 is not 0.3 in binary: the test tells them apart


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
