"""Schedules as typed data: every registered schedule's actions are valid, deadlock-free and hold
in flight what its object claims; split backwards (I, W) simulate and bad ones are refused; the
closed forms equal the simulation where they claim to; nothing but the schedule object knows a
schedule by its name."""

from __future__ import annotations

import ast
import itertools
import random

import pytest

from conftest import REPO
from hetlaunch.launcher.planning.cost_model import in_flight
from hetlaunch.runtime.registry import SCHEDULE_NAMES
from hetlaunch.runtime.schedules import (
    SCHEDULES,
    Action,
    B,
    F,
    I,
    W,
    max_in_flight,
    one_f_one_b,
    parse_actions,
    schedule_named,
    simulate,
    simulated_timeline,
    validate_actions,
)

GRID = list(itertools.product(range(1, 7), range(1, 9)))  # (stages, micro-batches)


def window_vectors(name: str, num_stages: int, num_microbatches: int):
    """Every window vector the schedule takes: for a deepening one each non-increasing vector from
    its own windows up to M (0 where a stage keeps its own), else only its own."""
    schedule = SCHEDULES[name]
    own = [schedule.in_flight(j, num_stages, num_microbatches) for j in range(num_stages)]
    if not schedule.deepens:
        yield (0,) * num_stages
        return

    def grow(j, above, prefix):
        if j == num_stages:
            yield prefix
            return
        for w in range(own[j], min(above, num_microbatches) + 1):
            yield from grow(j + 1, w, prefix + (0 if w == own[j] else w,))

    yield from grow(0, num_microbatches, ())


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_is_valid_deadlock_free_and_holds_what_it_claims(name):
    schedule, vectors = SCHEDULES[name], 0
    for num_stages, m in GRID:
        for windows in window_vectors(name, num_stages, m):
            per_stage = schedule.actions(num_stages, m, windows)
            for j, (actions, w) in enumerate(zip(per_stage, windows)):
                validate_actions(actions, m, stage_index=j)  # F once, then B once, each stage its own
                assert max_in_flight(actions) == schedule.in_flight(j, num_stages, m, w), (num_stages, m, windows, j)
            makespan = simulate(per_stage)  # raises on a deadlock
            assert 3.0 * m <= makespan <= 3.0 * m * num_stages
            vectors += 1
    assert vectors > len(GRID) or not schedule.deepens  # the deeper windows were walked too


def test_the_planner_counts_what_the_schedule_object_claims():
    for name in SCHEDULE_NAMES:
        for num_stages, m in GRID:
            for j in range(num_stages):
                assert in_flight(name, j, num_stages, m) == schedule_named(name).in_flight(j, num_stages, m)


def _closed_form(name: str, compute: list[float], link: list[float], latency: list[float], m: int) -> float:
    """The schedule's closed form from per-stage compute, outgoing link time and latency."""
    schedule, num_stages = SCHEDULES[name], len(compute)
    sum_term = round_trip = window_max = 0.0
    for j in range(num_stages - 1, -1, -1):
        hop = compute[j] + 2 * (latency[j] + link[j])
        sum_term += hop
        round_trip += hop
        window_max = max(window_max, schedule.window_term(round_trip, j, num_stages, m))
    return schedule.closed_step(m, max(compute), max(link), sum_term, window_max)


def test_gpipe_closed_form_is_its_simulation_with_uneven_stages_and_links():
    rng = random.Random(3)
    for num_stages, m in GRID:
        compute = [rng.uniform(0.001, 0.05) for _ in range(num_stages)]
        link = [rng.uniform(0.0, 0.1) for _ in range(num_stages - 1)] + [0.0]
        latency = [rng.uniform(0.0, 0.15) for _ in range(num_stages - 1)] + [0.0]
        want = simulate(SCHEDULES["gpipe"].actions(num_stages, m), [t / 3 for t in compute],
                        [2 * t / 3 for t in compute], link[:-1], latency[:-1])
        assert _closed_form("gpipe", compute, link, latency, m) == pytest.approx(want, rel=1e-9), (num_stages, m)


def test_1f1b_closed_form_is_its_simulation_on_even_stages_with_enough_microbatches():
    # With M >= S and no links, 1F1B's own windows never limit it: (M + S - 1) t, as simulated.
    for num_stages, m in GRID:
        if m < num_stages:
            continue
        compute = [0.03] * num_stages
        want = simulate(SCHEDULES["1f1b"].actions(num_stages, m), [0.01] * num_stages, [0.02] * num_stages)
        got = _closed_form("1f1b", compute, [0.0] * num_stages, [0.0] * num_stages, m)
        assert got == pytest.approx(want, rel=1e-9), (num_stages, m)


def test_registry_and_names():
    assert tuple(SCHEDULES) == SCHEDULE_NAMES
    assert all(SCHEDULES[n].name == n and SCHEDULES[n].title for n in SCHEDULE_NAMES)
    with pytest.raises(ValueError, match="unknown schedule 'zb'.*1f1b, gpipe"):
        schedule_named("zb")
    with pytest.raises(ValueError, match="a window is for 1f1b only, not gpipe"):
        SCHEDULES["gpipe"].stage_actions(0, 2, 4, window=4)
    assert parse_actions("F0 I1 W1 B2", 3) == [Action(3, F, 0), Action(3, I, 1), Action(3, W, 1), Action(3, B, 2)]
    with pytest.raises(ValueError, match="cannot read actions"):
        parse_actions("F0 X1", 0)


def test_the_cost_model_never_tests_a_schedule_by_its_name():
    """Its closed form, windows and in-flight counts come from the schedule object."""
    tree = ast.parse((REPO / "launcher" / "planning" / "cost_model.py").read_text())
    named = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
             for side in [node.left, *node.comparators]
             if isinstance(side, ast.Constant) and side.value in SCHEDULE_NAMES]
    assert not named, f"cost_model.py compares with a schedule name on lines {named}"


# --- Split backwards: I (input gradient) and W (weight gradients) ----------------------------------

def zb_h1_like(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """A hand-made zero-bubble list in the way of ZB-H1: 1F1B's order with each B split into an I
    at its place and a W put off until `stage` more I's have run (the last stage defers most),
    the rest of the W's at the end. Gradients travel up the pipeline at I's speed, and the W's
    fill what would be the drain's bubble."""
    actions, deferred = [], []
    for a in one_f_one_b(stage, num_stages, num_microbatches):
        if a.kind is not B:
            actions.append(a)
            continue
        actions.append(Action(stage, I, a.microbatch))
        deferred.append(a.microbatch)
        if len(deferred) > stage:
            actions.append(Action(stage, W, deferred.pop(0)))
    return actions + [Action(stage, W, m) for m in deferred]


def test_one_microbatch_split_into_i_and_w_by_hand():
    # F0 [0,1] -> F0 [1,2] -> I0 [2,3] on stage 1, its W0 [3,4] while stage 0 runs I0 [3,4], W0 [4,5];
    # with full backwards stage 0's B0 waits for stage 1's whole B0: [4,6].
    split = [parse_actions("F0 I0 W0", s) for s in range(2)]
    assert simulate(split, [1, 1], [2, 2]) == 5.0
    assert simulate([parse_actions("F0 B0", s) for s in range(2)], [1, 1], [2, 2]) == 6.0
    # An I of its own cost: the W is the rest of the backward (1.5), stage 0's W0 ends at 4.5.
    assert simulate(split, [1, 1], [2, 2], input_grad_cost=[0.5, 0.5]) == 4.5
    assert simulate(split, [1, 1], [2, 2], input_grad_cost=[0.5, 0.5], weight_grad_cost=[0.5, 0.5]) == 3.5
    timeline = simulated_timeline(split, [1, 1], [2, 2], [0.0], [0.0])
    assert [(str(a), t0, t1) for a, t0, t1 in timeline[0]] == [("0F0", 0, 1), ("0I0", 3, 4), ("0W0", 4, 5)]


def test_a_zb_h1_like_schedule_is_valid_deadlock_free_and_shrinks_the_bubble():
    for num_stages, m in GRID:
        split = [zb_h1_like(s, num_stages, m) for s in range(num_stages)]
        for s, actions in enumerate(split):
            validate_actions(actions, m, stage_index=s)  # F once, then I once, then W once
        makespan = simulate(split)  # F 1, I and W 1 each (half the backward of 2)
        plain = simulate([one_f_one_b(s, num_stages, m) for s in range(num_stages)])
        assert makespan <= plain
        if m >= num_stages:  # the bubble is (S - 1)(F + I - W), 1F1B's (S - 1)(F + B)
            assert makespan == 3 * m + (num_stages - 1) and plain == 3 * (m + num_stages - 1)
        timeline = simulated_timeline(split, [1.0] * num_stages, [2.0] * num_stages, [0.0] * (num_stages - 1),
                                      [0.0] * (num_stages - 1))
        assert [[a for a, _, _ in stage] for stage in timeline] == split
        assert max(t1 for stage in timeline for _, _, t1 in stage) == makespan


def test_bad_split_backwards_are_refused():
    w_first = parse_actions("F0 W0 I0", 0)
    with pytest.raises(ValueError, match="0W0 at position 1 comes before its input gradient 0I0"):
        validate_actions(w_first, 1)
    with pytest.raises(ValueError, match="deadlocks at stage 0 W0 waits for stage 0 I0"):
        simulate([w_first])
    with pytest.raises(ValueError, match="before its forward"):
        validate_actions(parse_actions("I0 F0 W0", 0), 1)
    with pytest.raises(ValueError, match="missing actions: 0W0"):
        validate_actions(parse_actions("F0 I0", 0), 1)
    both = parse_actions("F0 I0 B0 W0", 0)
    with pytest.raises(ValueError, match="both a B and an I or W"):
        validate_actions(both, 1)
    with pytest.raises(ValueError, match="a B is I and W at once"):
        simulate([both])
    with pytest.raises(ValueError, match="belongs to stage 1, not stage 0"):
        validate_actions(parse_actions("F0 B0", 1), 1, stage_index=0)
    with pytest.raises(ValueError, match="stage 0's list holds another stage's action 1F0"):
        simulate([parse_actions("F0 B0", 1), parse_actions("F0 B0", 1)])
    # Stage 0's I0 needs the gradient stage 1 sends when its I0 (or B0) ends: never here.
    with pytest.raises(ValueError, match="stage 0 I0 waits for stage 1 I0"):
        simulate([parse_actions("F0 I0 W0", 0), parse_actions("F0 W0 I0", 1)])


# --- How far a closed form is from the simulation, as its docstring says ----------------------------

def _random_pipelines(seed: int, count: int = 300):
    """The docstring's pipelines: 2-6 stages, 4-16 micro-batches, compute per stage uniform, each
    boundary's link and latency uniform from none to five mean stage times."""
    rng = random.Random(seed)
    for _ in range(count):
        num_stages, m = rng.randint(2, 6), rng.randint(4, 16)
        compute = [rng.uniform(0.01, 0.05) for _ in range(num_stages)]
        mean = sum(compute) / num_stages
        link = [rng.uniform(0.0, 5.0) * mean for _ in range(num_stages - 1)] + [0.0]
        latency = [rng.uniform(0.0, 5.0) * mean for _ in range(num_stages - 1)] + [0.0]
        yield num_stages, m, compute, link, latency


def _closed_form_errors(name: str) -> list[float]:
    """closed form / simulation - 1 over the pipelines (forward a third of t, backward two thirds)."""
    errors = []
    for num_stages, m, compute, link, latency in _random_pipelines(seed=0):
        simulated = simulate(SCHEDULES[name].actions(num_stages, m), [t / 3 for t in compute],
                             [2 * t / 3 for t in compute], link[:-1], latency[:-1])
        errors.append(_closed_form(name, compute, link, latency, m) / simulated - 1)
    return errors


def test_zb_h2s_closed_form_is_as_far_from_the_simulation_as_its_docstring_says():
    """The figures in ZeroBubbleH2's docstring (its own and ZB-H1's on the same pipelines) are
    what this measures, to the percent; a change of schedule or closed form must restate them."""
    import re

    doc = " ".join(SCHEDULES["zb-h2"].__doc__.split())
    stated = re.search(r"off by (\d+)% on average \((-?\d+)% to \+(\d+)%; ZB-H1's closed form by (\d+)%, "
                       r"(-?\d+)% to \+(\d+)%", doc)
    assert stated, "ZeroBubbleH2's docstring no longer states its closed form's error"
    measured = []
    for name in ("zb-h2", "zb-h1"):
        errors = _closed_form_errors(name)
        measured += [round(100 * sum(abs(e) for e in errors) / len(errors)), round(100 * min(errors)),
                     round(100 * max(errors))]
    assert [int(g) for g in stated.groups()] == measured
    # The deeper window never makes the closed form slower than ZB-H1's.
    for num_stages, m, compute, link, latency in _random_pipelines(seed=0):
        assert _closed_form("zb-h2", compute, link, latency, m) <= _closed_form("zb-h1", compute, link, latency, m)
