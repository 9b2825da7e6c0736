"""The planner's fast paths through runtime/simulation.py's dependency simulation, for its
commonest pipelines: one stage per device, only F and B actions (1F1B at any windows, GPipe).
The same arithmetic in the same order as `simulate_compiled` (tests/stage/test_simulation_fast_path.py
compares them to the bit); what they save is bookkeeping, since the planner prices thousands of
candidates. Split backwards and devices holding several stages stay with `simulate_compiled`.

`simulate_in_order` and `simulate_stages` are runtime/_simcore.c's where that extension was built
(the same arithmetic on the same doubles; 5x and 12x faster a call on 6 stages of 64 micro-batches; tests/stage/test_simulation_core.py
compares them to the bit and whole plans made with each), else the Python loops below.
"""

from __future__ import annotations

from itertools import repeat

from hetlaunch.runtime.actions import B, F, Action


def compiled_stage(actions: list[Action], stage: int) -> tuple[int, ...] | None:
    """One stage's list for `simulate_stages`: m for F(m), ~m for B(m); None where it holds any
    other kind or another stage's action (then only `simulate_compiled` prices it)."""
    if any(a.stage_index != stage or a.kind not in (F, B) for a in actions):
        return None
    return tuple(a.microbatch if a.kind is F else ~a.microbatch for a in actions)


def stage_order(plan: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...]:
    """An order of every (stage, action) of `compiled_stage` lists in which each action comes after
    what it waits for: the order simulate_stages' sweep runs them in, which depends on the lists
    only. `simulate_in_order` then prices any costs in one pass without readiness checks."""
    order: list[tuple[int, int]] = []
    zeros = [0.0] * len(plan)
    simulate_stages(plan, zeros, zeros, zeros, zeros, zeros, order)  # the compiled one where built
    return tuple(order)


def simulate_in_order_python(order: tuple[tuple[int, int], ...], num_microbatches: int,
                             forward_cost: list[float], backward_cost: list[float], link_cost: list[float],
                             latency: list[float], optimizer_cost: list[float]) -> float:
    """simulate_stages' step from its `stage_order`: the same arithmetic in one pass (an action's
    start depends only on finished actions, and each wire's messages leave in their sender's order)."""
    S = len(forward_cost)
    last = S - 1
    f_done = [[0.0] * num_microbatches for _ in range(S)]
    f_in = [[0.0] * num_microbatches for _ in range(S)]
    b_in = [[0.0] * num_microbatches for _ in range(S)]
    down_free = [0.0] * S
    up_free = [0.0] * S
    free_at = [0.0] * S
    for d, m in order:
        t = free_at[d]
        if m >= 0:
            if d:
                ready = f_in[d][m]
                if ready > t:
                    t = ready
            t += forward_cost[d]
            f_done[d][m] = t
            if d < last:
                down = down_free[d]
                down = (t if t > down else down) + link_cost[d]
                down_free[d] = down
                f_in[d + 1][m] = down + latency[d]
        else:
            m = ~m
            ready = f_done[d][m]
            if d < last:
                grad = b_in[d][m]
                if grad > ready:
                    ready = grad
            t = (ready if ready > t else t) + backward_cost[d]
            if d:
                up = up_free[d]
                up = (t if t > up else up) + link_cost[d - 1]
                up_free[d] = up
                b_in[d - 1][m] = up + latency[d - 1]
        free_at[d] = t
    return max(t + o for t, o in zip(free_at, optimizer_cost))


def simulate_stages_python(plan: tuple[tuple[int, ...], ...], forward_cost: list[float],
                           backward_cost: list[float], link_cost: list[float], latency: list[float],
                           optimizer_cost: list[float], order: list | None = None) -> float:
    """`simulate_compiled` for the planner's commonest case, one stage per device and only F and B
    (1F1B at any windows, GPipe), from `compiled_stage` lists: the same arithmetic in the same
    order (tests/stage/test_simulation_fast_path.py compares them), in a loop with nothing to
    tell apart but F from B, since the planner prices thousands of candidates this way."""
    S = len(plan)
    num_mb = len(plan[0]) // 2
    last = S - 1
    f_done = [[None] * num_mb for _ in range(S)]
    f_in = [[None] * num_mb for _ in range(S)]  # when an activation has arrived at stage s
    b_in = [[None] * num_mb for _ in range(S)]  # when a gradient has arrived at stage s
    down_free = [0.0] * S  # the wire after stage s, activations going down
    up_free = [0.0] * S  # the wire before stage s, gradients going up
    next_idx = [0] * S
    free_at = [0.0] * S
    remaining = sum(len(a) for a in plan)
    down_the_pipe, up_the_pipe = range(S), range(S - 1, -1, -1)
    sweep = 0
    while remaining:
        progressed = False
        # Start times depend only on finished actions, so the order of the sweep does not change
        # the result; alternating it lets activations run down and gradients up in one sweep
        # each, where one direction only would move gradients a stage per sweep.
        sweep += 1
        for d in down_the_pipe if sweep % 2 else up_the_pipe:
            actions, i, n = plan[d], next_idx[d], len(plan[d])
            if i == n:
                continue
            t, done, arrived, grads = free_at[d], f_done[d], f_in[d], b_in[d]
            f_c, b_c = forward_cost[d], backward_cost[d]
            if d < last:
                wire, lat, down, nxt = link_cost[d], latency[d], down_free[d], f_in[d + 1]
            if d:
                wire_up, lat_up, up, prev = link_cost[d - 1], latency[d - 1], up_free[d], b_in[d - 1]
            start = i
            while i < n:
                m = actions[i]
                if m >= 0:  # forward
                    if d:
                        ready = arrived[m]
                        if ready is None:
                            break
                        if ready > t:
                            t = ready
                    t += f_c
                    done[m] = t
                    if d < last:  # the activation leaves now, behind what is still on the wire
                        down = (t if t > down else down) + wire
                        nxt[m] = down + lat
                else:
                    m = ~m
                    ready = done[m]
                    if ready is None:
                        break
                    if d < last:
                        grad = grads[m]
                        if grad is None:
                            break
                        if grad > ready:
                            ready = grad
                    t = (ready if ready > t else t) + b_c
                    if d:
                        up = (t if t > up else up) + wire_up
                        prev[m] = up + lat_up
                i += 1
            if i != start:
                if order is not None:
                    order.extend(zip(repeat(d), actions[start:i]))
                free_at[d], next_idx[d] = t, i
                remaining -= i - start
                progressed = True
                if d < last:
                    down_free[d] = down
                if d:
                    up_free[d] = up
        if not progressed:
            raise ValueError("schedule deadlocks")
    return max(t + o for t, o in zip(free_at, optimizer_cost))


try:
    from hetlaunch.runtime import _simcore
except ImportError:  # not built (no C compiler at install): the Python loops, same plans
    _simcore = None
COMPILED = _simcore is not None
simulate_in_order = _simcore.simulate_in_order if COMPILED else simulate_in_order_python
simulate_stages = _simcore.simulate_stages if COMPILED else simulate_stages_python
