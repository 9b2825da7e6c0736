"""The cut program's fronts where the closed form prices compute, link and round trip apart
(GPipe, ZB-H1, ZB-H2): the compiled three_term_fronts (launcher/planning/_cutfront.c) gives the
Python loops' fronts to the bit, in the same order, ties broken alike; the Python front's
staircase keeps exactly the points the definition keeps (a point no kept point beats or ties on
both the link and the sum); and whole plans made with either are the same plans."""

from __future__ import annotations

import random

import pytest

from hetlaunch.launcher.planning import chain_cuts, cut_front
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.cut_front import pareto_three_terms, three_term_fronts_python
from hetlaunch.launcher.planning.planner import plan
from plan_reference import random_suffix

needs_core = pytest.mark.skipif(not cut_front.COMPILED, reason="not built: see test_cut_front.py")


def _by_definition(points: list[tuple]) -> list[tuple]:
    """The front as first written: sorted stably by (compute, link, sum), each point checked against
    every point kept before it."""
    points = sorted(points, key=lambda p: (p[0], p[1], p[3]))
    kept: list[tuple] = []
    for p in points:
        if not any(q[1] <= p[1] and q[3] <= p[3] for q in kept):
            kept.append(p)
    return kept


def _bits(front: list[tuple]) -> list:
    return [[(type(v), v.hex() if isinstance(v, float) else v) for v in point] for point in front]


def test_the_staircase_keeps_what_the_definition_keeps():
    rng = random.Random(11)
    kept = 0
    for case in range(3000):
        value = (lambda: rng.choice([0.0, 0.5, 1.0, 2.0])) if case % 2 else (lambda: rng.uniform(0, 1))
        points = [(value(), value(), value(), value(), k, k, "none") for k in range(rng.randint(0, 60))]
        want = _by_definition(points)
        assert pareto_three_terms(list(points)) == want, points
        kept += len(want)
    assert kept > 10_000  # the cases keep points, and drop some: coarse values tie on every term


@needs_core
def test_the_compiled_fronts_give_the_python_fronts_to_the_bit():
    rng = random.Random(7)
    points = 0
    for case in range(3000):
        drawn = random_suffix(rng, coarse=case % 2 == 0)
        args = drawn[:7] + drawn[8:]  # no window term: no `deepens`
        want = three_term_fronts_python(*args)
        assert [_bits(f) for f in cut_front._cutfront.three_term_fronts(*args)] == [_bits(f) for f in want], args
        points += sum(len(front) for front in want)
    assert points > 5000


@needs_core
def test_bad_input_is_refused_not_read_past():
    time = static = activation = [0.0, 1.0, 2.0]
    crossings = [[None, (0.1, 0.0, 0.0, "none"), (0.1, 0.0, 0.0, "none")]]
    following = [None, None, [(0.5, 0.0, 0.0, 0.5, 2, -1, "none")]]  # the front at end 1 is missing
    for core in (cut_front._cutfront.three_term_fronts, three_term_fronts_python):
        with pytest.raises(TypeError):
            core([0], time, static, activation, 100.0, 1, 4, crossings, following, 2)
        # a memory that stops the range before end 1 never reads it
        assert core([0], time, static, activation, 0.5, 1, 4, crossings, following, 2) == [[]]
    core = cut_front._cutfront.three_term_fronts
    with pytest.raises(ValueError):  # a start or a last end past the layers
        core([5], time, static, activation, 1.0, 1, 4, crossings, following, 2)
    with pytest.raises(ValueError):
        core([0], time, static, activation, 1.0, 1, 4, crossings, following, 3)
    with pytest.raises(TypeError):  # prefixes as long as the following fronts
        core([0], [0.0], static, activation, 1.0, 1, 4, crossings, following, 2)
    with pytest.raises(TypeError):  # a point is numbers
        core([0], time, static, activation, 100.0, 1, 4, crossings, [None, [("a", 0, 0, 0)], []], 2)


@needs_core
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("compression", [CompressionConfig(), NONE], ids=["auto", "none"])
def test_plans_made_with_the_python_fronts_are_the_plans_made_with_the_compiled_ones(monkeypatch, schedule,
                                                                                     compression):
    from plan_reference import random_profile

    def plans():
        out = []
        for seed in range(3):
            result = plan(random_profile(random.Random(seed), 4, 2, 10), num_microbatches=8, schedule=schedule,
                          max_pipelines=2, compression=compression)
            out.append((result.tokens_per_s, [p.cost for p in result.pipelines]))  # every stage's every field
        return out

    compiled = plans()
    monkeypatch.setattr(chain_cuts, "three_term_fronts", three_term_fronts_python)
    assert plans() == compiled
