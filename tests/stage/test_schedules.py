"""Schedules checked as data: completeness, no deadlock, memory bound, makespan."""

import itertools

import pytest

from hetlaunch.runtime.schedules import (
    SCHEDULES,
    Action,
    Kind,
    gpipe,
    max_in_flight,
    one_f_one_b,
    parse_actions,
    schedule_for,
    simulate,
    validate_actions,
)

GRID = list(itertools.product(range(1, 7), range(1, 10)))  # (num_stages, num_microbatches)


def plan(name, num_stages, num_microbatches):
    return [schedule_for(name, s, num_stages, num_microbatches) for s in range(num_stages)]


def parse(text, stage=0):
    return parse_actions(text, stage)


def short(actions):
    return " ".join(a.label for a in actions)


def test_action_str_and_registry():
    assert str(Action(1, Kind.FORWARD, 3)) == "1F3" and Action(0, Kind.BACKWARD, 0).label == "B0"
    assert set(SCHEDULES) == {"1f1b", "gpipe", "zb-h1", "zb-h2"}
    with pytest.raises(ValueError, match="1f1b.*gpipe.*zb-h1.*zb-h2"):
        schedule_for("interleaved", 0, 2, 2)


def test_known_1f1b_orders():
    # 4 stages, 6 micro-batches: stage 0 warms up 3 forwards, the last stage none.
    assert short(one_f_one_b(0, 4, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert short(one_f_one_b(3, 4, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert {a.stage_index for a in one_f_one_b(3, 4, 6)} == {3}
    # Fewer micro-batches than stages: warm-up is capped at M.
    assert short(one_f_one_b(0, 4, 2)) == "F0 F1 B0 B1"
    assert short(gpipe(1, 3, 3)) == "F0 F1 F2 B0 B1 B2"


SPLIT = {"zb-h1", "zb-h2"}  # schedules whose backwards are split into I and W


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_microbatch_forward_then_backward_once(name):
    backward = ["I", "W"] if name in SPLIT else ["B"]
    for num_stages, m in GRID:
        for actions in plan(name, num_stages, m):
            validate_actions(actions, m)  # raises on a missing, repeated or early action
            assert sorted(a.label for a in actions) == sorted(f"{k}{i}" for i in range(m) for k in ["F", *backward])
            for i in range(m):
                s = actions[0].stage_index
                order = [actions.index(Action(s, Kind(k), i)) for k in ["F", *backward]]
                assert order == sorted(order)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_no_deadlock_on_the_grid(name):
    for num_stages, m in GRID:
        makespan = simulate(plan(name, num_stages, m))
        # Never faster than the last stage's own work, never slower than fully serial.
        assert 3.0 * m <= makespan <= 3.0 * m * num_stages


def test_memory_bounds():
    for num_stages, m in GRID:
        for s in range(num_stages):
            assert max_in_flight(one_f_one_b(s, num_stages, m)) == min(num_stages - s, m)
            assert max_in_flight(gpipe(s, num_stages, m)) == m


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - SPLIT))
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_uniform_makespan(name, f, b):
    for num_stages, m in GRID:
        got = simulate(plan(name, num_stages, m), [f] * num_stages, [b] * num_stages)
        assert got == pytest.approx((m + num_stages - 1) * (f + b))


def test_uneven_costs_bottleneck_stage():
    # One slow stage dominates: with many micro-batches the makespan approaches M * (its f + b).
    num_stages, m = 3, 8
    fwd, bwd = [1.0, 4.0, 1.0], [2.0, 8.0, 2.0]
    got = simulate(plan("1f1b", num_stages, m), fwd, bwd)
    assert m * 12.0 <= got <= m * 12.0 + 2 * 3.0 + 1e-9


def test_single_stage_is_serial():
    assert simulate([one_f_one_b(0, 1, 5)], [1.5], [2.5]) == pytest.approx(5 * 4.0)


def test_broken_schedules_deadlock():
    # Stage 1 backwards micro-batch 0 before it has forwarded it.
    with pytest.raises(ValueError, match="schedule deadlocks at .*stage 1 B0"):
        simulate([parse("F0 B0"), parse("B0 F0", 1)])
    # Stage 0 waits for B1 before doing the forward stage 1 needs first.
    with pytest.raises(ValueError, match="schedule deadlocks"):
        simulate([parse("F0 B1 F1 B0"), parse("F1 B1 F0 B0", 1)])
    # An action whose dependency is never scheduled can never run.
    with pytest.raises(ValueError, match="schedule deadlocks at stage 1 F1 waits for stage 0 F1"):
        simulate([parse("F0 B0"), parse("F0 B0 F1 B1", 1)])


def test_validation_errors():
    with pytest.raises(ValueError, match="before its forward"):
        validate_actions(parse("B0 F0"), 1)
    with pytest.raises(ValueError, match="missing.*B1"):
        validate_actions(parse("F0 F1 B0"), 2)
    with pytest.raises(ValueError, match="twice"):
        validate_actions(parse("F0 F0 B0"), 1)
    with pytest.raises(ValueError, match="repeats"):
        simulate([parse("F0 F0 B0")])
    with pytest.raises(ValueError, match="forward_cost"):
        simulate(plan("1f1b", 2, 2), forward_cost=[1.0])
    with pytest.raises(ValueError, match="stage must be"):
        one_f_one_b(3, 3, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(0, 2, 0)


def test_deeper_windows_keep_more_in_flight_and_never_deadlock():
    import random

    rng = random.Random(5)
    for _ in range(300):
        stages, m = rng.randint(1, 6), rng.randint(1, 12)
        windows, above = [], m
        for j in range(stages):  # at least 1F1B's own, at most the one above
            own = min(stages - j, m)
            windows.append(rng.randint(own, max(own, min(above, m))))
            above = windows[-1]
        per_stage = [schedule_for("1f1b", j, stages, m, windows[j]) for j in range(stages)]
        for j, actions in enumerate(per_stage):
            validate_actions(actions, m)
            assert max_in_flight(actions) == min(windows[j], m)
        simulate(per_stage)  # raises on a deadlock
    with pytest.raises(ValueError, match="below 1F1B's 3"):
        schedule_for("1f1b", 0, 3, 4, window=2)
    with pytest.raises(ValueError, match="for 1f1b only"):
        schedule_for("gpipe", 0, 3, 4, window=4)


def test_a_deeper_window_hides_a_distant_link():
    # Two stages over a link with 100 ms latency each way: 1F1B's window of 2 waits for the
    # round trip; a window of 8 keeps the first stage busy meanwhile.
    def step(window: int) -> float:
        per_stage = [schedule_for("1f1b", 0, 2, 8, window), schedule_for("1f1b", 1, 2, 8)]
        return simulate(per_stage, [0.01, 0.01], [0.02, 0.02], [0.001], [0.1])

    assert step(8) < 0.6 * step(0)


@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_zb_h1_leaves_a_third_of_1f1bs_bubble_at_1f1bs_peak_memory(f, b):
    """I and W half a backward each: ZB-H1's bubble is (S - 1) f where 1F1B's is (S - 1)(f + b)
    (a third of it with b = 2f, as the paper says) when a W is no longer than an F, and never
    more than 1F1B's otherwise; every stage holds min(S, M) micro-batches, 1F1B's first stage's,
    and stage s holds each W back by s I's."""
    for num_stages, m in GRID:
        zb, one = plan("zb-h1", num_stages, m), plan("1f1b", num_stages, m)
        assert [max_in_flight(a) for a in zb] == [min(num_stages, m)] * num_stages
        makespan = simulate(zb, [f] * num_stages, [b] * num_stages)
        assert makespan <= simulate(one, [f] * num_stages, [b] * num_stages) + 1e-9
        if m >= num_stages and b <= 2 * f:  # the paper's (S - 1)(F + I - W) needs a W no longer than an F
            assert makespan == pytest.approx(m * (f + b) + (num_stages - 1) * f), (num_stages, m)
    assert short(schedule_for("zb-h1", 0, 4, 6)) == "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5"
    assert short(schedule_for("zb-h1", 3, 4, 6)) == "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5"
