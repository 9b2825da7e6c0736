"""The planner's compiled simulation core (runtime/_simcore.c) is its Python loops, faster: the
same step to the bit, the same recorded order, the same refusal of a deadlocking schedule, and
whole plans made with each path are the same plans (a user without a C compiler gets the Python
loops and the plans this suite checks)."""

from __future__ import annotations

import random

import pytest

from hetlaunch.launcher.planning import cost_model
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.planner import plan
from hetlaunch.runtime import fast_simulation
from hetlaunch.runtime.fast_simulation import compiled_stage, simulate_in_order_python, simulate_stages_python
from hetlaunch.runtime.schedules import schedule_for


def test_the_compiled_core_is_built():
    # pip install -e . builds it wherever a C compiler is found (setup.py); CI must test it, not skip it
    assert fast_simulation.COMPILED, "runtime/_simcore.c was not built: install a C compiler, then pip install -e ."


def _case(rng: random.Random):
    S, M = rng.randint(1, 8), rng.randint(1, 16)
    schedule = rng.choice(["1f1b", "gpipe"])
    own = [min(S - j, M) for j in range(S)]
    windows, above = [], M
    for j in range(S):
        w = own[j] if j == S - 1 or schedule == "gpipe" else max(own[j], min(rng.randint(own[j], M), above))
        windows.append(w if w > own[j] else 0)
        above = max(w, own[j])
    plan_lists = tuple(compiled_stage(schedule_for(schedule, j, S, M, w), j) for j, w in enumerate(windows))
    costs = ([rng.uniform(0.001, 0.02) for _ in range(S)], [rng.uniform(0.001, 0.04) for _ in range(S)],
             [rng.choice([0.0, rng.uniform(0, 0.03)]) for _ in range(S - 1)],
             [rng.uniform(0, 0.05) for _ in range(S - 1)], [rng.uniform(0, 0.01) for _ in range(S)])
    return plan_lists, M, costs


needs_core = pytest.mark.skipif(not fast_simulation.COMPILED, reason="the core was not built: see test_the_compiled_core_is_built")


@needs_core
def test_the_compiled_loops_give_the_python_loops_steps_and_order_to_the_bit():
    rng = random.Random(11)
    for _ in range(300):
        plan_lists, M, costs = _case(rng)
        order_c, order_py = [], []
        step_c = fast_simulation._simcore.simulate_stages(plan_lists, *costs, order_c)
        step_py = simulate_stages_python(plan_lists, *costs, order_py)
        assert step_c == step_py
        assert order_c == order_py
        order = tuple(order_py)
        assert fast_simulation._simcore.simulate_in_order(order, M, *costs) == simulate_in_order_python(order, M, *costs)


@needs_core
def test_a_deadlocking_schedule_and_bad_input_are_refused_as_python_refuses_them():
    core = fast_simulation._simcore
    costs = ([0.1, 0.1], [0.2, 0.2], [0.0], [0.0], [0.0, 0.0])
    deadlock = ((~0, 0), (0, ~0))  # stage 0 waits for a gradient before it has sent its forward
    for simulate in (core.simulate_stages, simulate_stages_python):
        with pytest.raises(ValueError, match="schedule deadlocks"):
            simulate(deadlock, *costs)
    with pytest.raises(IndexError):
        core.simulate_stages(((0, ~5), (0, ~0)), *costs)  # micro-batch 5 of 1
    with pytest.raises(TypeError):
        core.simulate_in_order(((0, "F"),), 1, *costs)
    with pytest.raises(TypeError):
        core.simulate_stages(((0, ~0), (0, ~0)), ["fast", 0.1], *costs[1:])
    assert core.simulate_stages(((0, ~0), (0, ~0)), *costs) == simulate_stages_python(((0, ~0), (0, ~0)), *costs)
    with pytest.raises(MemoryError):  # S x M cells past what can be addressed: refused, not wrapped around
        core.simulate_in_order(((0, 0),), 2**62, [0.1] * 4, [0.2] * 4, [0.0] * 3, [0.0] * 3, [0.0] * 4)

    class Shrinking(list):  # says it holds more than it iterates
        def __len__(self):
            return 10
    assert core.simulate_stages((Shrinking([0, ~0]), (0, ~0)), *costs) == simulate_stages_python(((0, ~0), (0, ~0)), *costs)

    class Meddling:  # a number that empties the caller's list while it is read
        def __float__(self):
            held.clear()
            return 0.1
    held = [Meddling(), 0.1]
    assert core.simulate_stages(((0, ~0), (0, ~0)), held, *costs[1:]) > 0


@needs_core
@pytest.mark.parametrize("compression", [CompressionConfig(), NONE], ids=["auto", "none"])
def test_plans_made_with_the_python_loops_are_the_plans_made_with_the_compiled_core(monkeypatch, compression):
    from plan_reference import random_profile

    def plans():
        out = []
        for seed in range(3):
            result = plan(random_profile(random.Random(seed), 5, 2, 8), num_microbatches=6, schedule="1f1b",
                          max_pipelines=2, compression=compression)
            out.append((result.tokens_per_s, [p.cost for p in result.pipelines]))  # every stage's every field
        return out

    compiled = plans()
    monkeypatch.setattr(cost_model, "simulate_in_order", simulate_in_order_python)
    monkeypatch.setattr(cost_model, "simulate_stages", simulate_stages_python)
    monkeypatch.setattr(fast_simulation, "simulate_stages", simulate_stages_python)  # stage_order's
    assert plans() == compiled


def test_the_lists_1f1b_and_gpipe_build_from_integers_are_their_compiled_actions():
    from hetlaunch.runtime.fast_simulation import compiled_stage
    from hetlaunch.runtime.schedules import SCHEDULES

    checked = 0
    for schedule in SCHEDULES.values():  # the others build theirs from their actions (None: split backwards)
        for S, M in ((1, 1), (1, 5), (3, 1), (3, 2), (4, 7), (6, 9)):
            for j in range(S):
                for window in [0, 1, 2, S, M + 2] if schedule.deepens else [0, 2]:
                    def outcome(build):
                        try:
                            return build(), None
                        except ValueError as err:  # a window below 1F1B's own, or for GPipe at all
                            return None, str(err)
                    want = outcome(lambda: compiled_stage(schedule.stage_actions(j, S, M, window), j))
                    assert outcome(lambda: schedule.compiled_list(j, S, M, window)) == want, (schedule.name, S, M, j)
                    checked += 1
    assert checked > 190
