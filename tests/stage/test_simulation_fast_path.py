"""The planner's fast simulation paths price exactly what the general one does: simulate_stages
(one stage per device, F and B only) and simulate_in_order (its recorded order, one pass) give
the step of simulate_compiled to the last bit on 1F1B at random windows and on GPipe, and
compiled_stage refuses lists it cannot run (split backwards)."""

from __future__ import annotations

import random

import pytest

from hetlaunch.runtime.schedules import (compiled, compiled_stage, schedule_for, simulate_compiled, simulate_in_order,
                                         simulate_stages, stage_order)


def _windows(rng: random.Random, S: int, M: int) -> list[int]:
    """A vector the executor runs: own_j <= w_j <= M, never growing down the pipeline, last at its own."""
    own = [min(S - j, M) for j in range(S)]
    out, above = [], M
    for j in range(S):
        w = own[j] if j == S - 1 else rng.randint(own[j], max(own[j], above))
        w = max(own[j], min(w, above))
        out.append(w)
        above = w
    return [w if w > own[j] else 0 for j, w in enumerate(out)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fast_paths_equal_the_general_simulation(schedule):
    rng = random.Random(3)
    for _ in range(200):
        S, M = rng.randint(1, 7), rng.randint(1, 12)
        windows = _windows(rng, S, M) if schedule == "1f1b" else [0] * S
        lists = [schedule_for(schedule, j, S, M, w) for j, w in enumerate(windows)]
        fast = tuple(compiled_stage(actions, j) for j, actions in enumerate(lists))
        forward = [rng.uniform(0.001, 0.02) for _ in range(S)]
        backward = [rng.uniform(0.001, 0.04) for _ in range(S)]
        link = [rng.choice([0.0, rng.uniform(0, 0.03)]) for _ in range(S - 1)]
        latency = [rng.uniform(0, 0.05) for _ in range(S - 1)]
        optimizer = [rng.uniform(0, 0.01) for _ in range(S)]
        want = simulate_compiled(compiled(lists), forward, backward, link, latency, optimizer)
        assert simulate_stages(fast, forward, backward, link, latency, optimizer) == want
        assert simulate_in_order(stage_order(fast), M, forward, backward, link, latency, optimizer) == want


def test_split_backwards_are_left_to_the_general_simulation():
    assert compiled_stage(schedule_for("zb-h1", 1, 3, 4), 1) is None
    assert compiled_stage(schedule_for("1f1b", 1, 3, 4), 1) is not None
