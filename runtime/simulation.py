"""The dependency simulation of one pipeline step: the step time the planner prices.

Each stage runs its own list of typed actions (runtime/actions.py) strictly in order, one at a
time. What an action waits for is what P2P send/recv enforces at run time:

* ``F(s, m)`` needs the activation of ``F(s-1, m)``;
* ``B(s, m)`` and ``I(s, m)`` need ``F(s, m)`` and the gradient sent by the next stage's
  ``I(s+1, m)`` or ``B(s+1, m)`` (the last stage's needs only its own forward, which computed
  the loss); when they end, the gradient of the stage's input leaves for the stage before;
* ``W(s, m)`` needs only ``I(s, m)`` on the same stage, and sends nothing;
* ``E(s, k)``, an evaluation forward of held-out micro-batch k, needs ``E(s-1, k)``'s activation,
  which shares the boundary's wire with training's.

Costs are per stage. An I and a W without costs of their own split the stage's backward cost
in half each (a B is an I and a W run back to back; the split is a stand-in until profiles
time the two halves); given one of them, the other is the rest of the backward.
"""

from __future__ import annotations

from hetlaunch.runtime.actions import B, E, F, I, W, Action

# Compiled kinds: small ints the simulation compares (a forward is the only falsy one, and the
# most common action, so it is told apart by truth alone).
_CODE = {F: 0, B: 1, I: 2, W: 3, E: 4}


def _deps(num_stages: int, a: Action, scheduled: set[Action]) -> list[Action]:
    """The actions that must finish before `a` may start: for the deadlock message."""
    s, m = a.stage_index, a.microbatch
    if a.kind in (F, E):
        return [Action(s - 1, a.kind, m)] if s > 0 else []
    if a.kind is W:
        return [Action(s, I, m)]
    deps = [Action(s, F, m)]
    if s < num_stages - 1:  # whichever of I and B the next stage runs sends the gradient
        deps.append(Action(s + 1, I, m) if Action(s + 1, I, m) in scheduled else Action(s + 1, B, m))
    return deps


def _costs(costs: list[float] | None, default: float, num_stages: int, what: str) -> list[float]:
    if costs is None:
        return [default] * num_stages
    if len(costs) != num_stages or any(c < 0 for c in costs):
        raise ValueError(f"{what} needs {num_stages} non-negative per-stage costs, got {costs}")
    return list(costs)


def split_backward(backward_cost: list[float], input_grad_cost: list[float] | None,
                   weight_grad_cost: list[float] | None) -> tuple[list[float], list[float]]:
    """(I, W) costs per stage: as given, else half the backward each, else the rest of it."""
    if input_grad_cost is None and weight_grad_cost is None:
        half = [b / 2 for b in backward_cost]
        return half, half
    if input_grad_cost is None:
        input_grad_cost = [b - w for b, w in zip(backward_cost, weight_grad_cost)]
    if weight_grad_cost is None:
        weight_grad_cost = [b - i for b, i in zip(backward_cost, input_grad_cost)]
    return input_grad_cost, weight_grad_cost


def simulate(
    per_stage: list[list[Action]],
    forward_cost: list[float] | None = None,
    backward_cost: list[float] | None = None,
    link_cost: list[float] | None = None,
    latency: list[float] | None = None,
    optimizer_cost: list[float] | None = None,
    input_grad_cost: list[float] | None = None,
    weight_grad_cost: list[float] | None = None,
    eval_cost: list[float] | None = None,
) -> float:
    """Run the per-stage action lists under the pipeline dependencies, each stage strictly in
    its own order; return the step's makespan. The step time the planner prices.

    Communication is what the executor does (runtime/executor.py, runtime/link.py): a stage
    sends its result asynchronously the moment an action ends and goes on; boundary ``j``
    (between stages j and j+1) carries each message for ``link_cost[j]`` seconds, one message
    after another in each direction (activations down, gradients up: a full-duplex link), and
    the message arrives ``latency[j]`` after it left the wire; a stage blocks only when the
    action it is at needs a message that has not arrived. After its last action a stage steps
    its optimizer (``optimizer_cost``). Default: forward 1, backward 2, free links, no
    optimizer; I and W as the module says.

    Raises ``ValueError("schedule deadlocks at ...")`` when no stage can progress.
    """
    for s, actions in enumerate(per_stage):
        strangers = [a for a in actions if a.stage_index != s]
        if strangers:
            raise ValueError(f"stage {s}'s list holds another stage's action {strangers[0]}")
    return simulate_devices(per_stage, forward_cost, backward_cost, link_cost, latency, optimizer_cost,
                            input_grad_cost, weight_grad_cost, eval_cost)


def simulate_devices(
    per_device: list[list[Action]],
    forward_cost: list[float] | None = None,
    backward_cost: list[float] | None = None,
    link_cost: list[float] | None = None,
    latency: list[float] | None = None,
    optimizer_cost: list[float] | None = None,
    input_grad_cost: list[float] | None = None,
    weight_grad_cost: list[float] | None = None,
    eval_cost: list[float] | None = None,
) -> float:
    """`simulate` where a device may hold several stages (interleaved and V-shaped schedules):
    each list is one device's actions, run strictly in its order, one at a time, whichever of
    its stages they belong to. Compute costs and boundaries are per *stage* (boundary j between
    stages j and j+1; a boundary inside one device costs what its caller says, usually nothing);
    ``optimizer_cost`` is per device; an evaluation forward costs ``eval_cost`` (default: the
    forward's). With one stage per device it is `simulate`."""
    if not per_device:
        raise ValueError("simulate needs at least one stage")
    num_stages = _check_lists(per_device)
    f_cost = _costs(forward_cost, 1.0, num_stages, "forward_cost")
    b_cost = _costs(backward_cost, 2.0, num_stages, "backward_cost")
    wire = _costs(link_cost, 0.0, num_stages - 1, "link_cost")
    lat = _costs(latency, 0.0, num_stages - 1, "latency")
    opt = _costs(optimizer_cost, 0.0, len(per_device), "optimizer_cost")
    i_given, w_given = (None if c is None else _costs(c, 0.0, num_stages, what)
                        for c, what in ((input_grad_cost, "input_grad_cost"), (weight_grad_cost, "weight_grad_cost")))
    i_cost, w_cost = split_backward(b_cost, i_given, w_given)
    if any(c < 0 for c in i_cost + w_cost):
        raise ValueError(f"input and weight gradient costs must not exceed the backward's: {i_cost}, {w_cost}")
    e_cost = _costs(eval_cost, 0.0, num_stages, "eval_cost") if eval_cost is not None else f_cost
    num_mb = 1 + max((a.microbatch for actions in per_device for a in actions), default=0)
    return _simulate(compiled(per_device), f_cost, b_cost, i_cost, w_cost, wire, lat, opt, per_device, num_mb,
                     e_cost=e_cost)


def _check_lists(per_device: list[list[Action]]) -> int:
    """What a deadlock would not reveal: an action twice, a stage's actions on two devices, a
    micro-batch both backwarded and split into I and W (its weight gradients counted twice).
    Returns the number of stages, which must be 0..n-1 with none missing."""
    holder: dict[int, int] = {}
    for d, actions in enumerate(per_device):
        for s in {a.stage_index for a in actions}:
            if holder.setdefault(s, d) != d:
                raise ValueError(f"stage {s}'s actions are on two devices' lists, {holder[s]} and {d}")
        if len(set(actions)) != len(actions):
            raise ValueError(f"stage {actions[0].stage_index} repeats an action: {' '.join(map(str, actions))}")
        for s in {a.stage_index for a in actions if a.kind is not E}:
            full = {a.microbatch for a in actions if a.kind is B and a.stage_index == s}
            split = sorted(full & {a.microbatch for a in actions if a.kind in (I, W) and a.stage_index == s})
            if split:
                raise ValueError(f"stage {s} has both B{split[0]} and I{split[0]} or W{split[0]}: "
                                 f"a B is I and W at once")
    num_stages = max(holder, default=-1) + 1
    missing = sorted(set(range(num_stages)) - set(holder))
    if missing:
        raise ValueError(f"no device runs stage {missing[0]}")
    return max(num_stages, 1)


def compiled(per_device: list[list[Action]]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The action lists as (kind code, micro-batch, stage) triples: what `simulate` walks. The
    planner keeps these per stage shape and simulates thousands of candidates with `simulate_compiled`."""
    return tuple(tuple((_CODE[a.kind], a.microbatch, a.stage_index) for a in actions) for actions in per_device)


def simulate_compiled(plan, forward_cost: list[float], backward_cost: list[float], link_cost: list[float],
                      latency: list[float], optimizer_cost: list[float], input_grad_cost: list[float] | None = None,
                      weight_grad_cost: list[float] | None = None) -> float:
    """`simulate_devices` on `compiled` action lists, costs given in full (no defaults, no checks)."""
    i_cost, w_cost = split_backward(backward_cost, input_grad_cost, weight_grad_cost)
    # Well formed (a schedule's): every micro-batch has at least two actions on each of a
    # device's stages, so half its list bounds the micro-batch count (exact for F and B alone).
    return _simulate(plan, forward_cost, backward_cost, i_cost, w_cost, link_cost, latency, optimizer_cost,
                     None, len(plan[0]) // 2)


def simulated_timeline(per_device: list[list[Action]], forward_cost: list[float], backward_cost: list[float],
                       link_cost: list[float], latency: list[float], input_grad_cost: list[float] | None = None,
                       weight_grad_cost: list[float] | None = None,
                       eval_cost: list[float] | None = None) -> list[list[tuple[Action, float, float]]]:
    """`simulate`'s schedule as (action, start, end) per device (per stage where each device holds
    one), from the step's start: the predicted timeline a trace shows beside the measured one."""
    ends: dict = {}
    i_cost, w_cost = split_backward(backward_cost, input_grad_cost, weight_grad_cost)
    _check_lists(per_device)
    _simulate(compiled(per_device), forward_cost, backward_cost, i_cost, w_cost, link_cost, latency,
              [0.0] * len(per_device), per_device, 1 + max(a.microbatch for actions in per_device for a in actions),
              ends, eval_cost or forward_cost)
    costs = {F: forward_cost, B: backward_cost, I: i_cost, W: w_cost, E: eval_cost or forward_cost}

    def span(a: Action) -> tuple[Action, float, float]:
        end = ends[a.kind][a.stage_index][a.microbatch]
        return a, end - costs[a.kind][a.stage_index], end
    return [[span(a) for a in actions] for actions in per_device]


def _simulate(plan, f_cost, b_cost, i_cost, w_cost, wire, lat, opt, per_device, num_mb: int,
              ends: dict | None = None, e_cost=None) -> float:
    num_stages = len(f_cost)
    num_devices = len(plan)
    # Plain lists indexed [stage][micro-batch]: the planner simulates thousands of candidates.
    f_done = [[None] * num_mb for _ in range(num_stages)]
    g_done = [[None] * num_mb for _ in range(num_stages)]  # the input's gradient: a B or an I ended
    w_done = [[None] * num_mb for _ in range(num_stages)]
    f_in = [[None] * num_mb for _ in range(num_stages)]  # when an activation has arrived at stage s
    b_in = [[None] * num_mb for _ in range(num_stages)]  # when a gradient has arrived at stage s
    e_done = [[None] * num_mb for _ in range(num_stages)]  # evaluation forwards, by held-out micro-batch
    e_in = [[None] * num_mb for _ in range(num_stages)]
    down_free = [0.0] * max(num_stages - 1, 0)  # each boundary's wire, activations going down
    up_free = [0.0] * max(num_stages - 1, 0)  # and gradients going up
    last = num_stages - 1
    next_idx = [0] * num_devices
    free_at = [0.0] * num_devices
    remaining = sum(len(a) for a in plan)
    while remaining:
        progressed = False
        for d in range(num_devices):
            # Run as far as this device can go; a start time depends only on finished
            # actions, so the sweep order does not change the result.
            actions, i = plan[d], next_idx[d]
            while i < len(actions):
                kind, m, s = actions[i]
                if not kind:  # forward
                    ready = 0.0 if s == 0 else f_in[s][m]
                    if ready is None:
                        break
                    end = (ready if ready > free_at[d] else free_at[d]) + f_cost[s]
                    f_done[s][m] = end
                    if s < last:  # the activation leaves now, behind what is still on the wire
                        leaves = end if end > down_free[s] else down_free[s]
                        down_free[s] = leaves + wire[s]
                        f_in[s + 1][m] = leaves + wire[s] + lat[s]
                elif kind == 4:  # an evaluation forward: the same wire down, nothing back
                    ready = 0.0 if s == 0 else e_in[s][m]
                    if ready is None:
                        break
                    end = (ready if ready > free_at[d] else free_at[d]) + e_cost[s]
                    e_done[s][m] = end
                    if s < last:
                        leaves = end if end > down_free[s] else down_free[s]
                        down_free[s] = leaves + wire[s]
                        e_in[s + 1][m] = leaves + wire[s] + lat[s]
                elif kind != 3:  # a full backward (1) or the input gradient alone (2)
                    ready = f_done[s][m]
                    if ready is None:
                        break
                    if s < last:
                        grad = b_in[s][m]
                        if grad is None:
                            break
                        ready = grad if grad > ready else ready
                    end = (ready if ready > free_at[d] else free_at[d]) + (b_cost[s] if kind == 1 else i_cost[s])
                    g_done[s][m] = end
                    if s > 0:
                        leaves = end if end > up_free[s - 1] else up_free[s - 1]
                        up_free[s - 1] = leaves + wire[s - 1]
                        b_in[s - 1][m] = leaves + wire[s - 1] + lat[s - 1]
                else:  # weight gradients: only this stage's own input gradient first
                    ready = g_done[s][m]
                    if ready is None:
                        break
                    end = (ready if ready > free_at[d] else free_at[d]) + w_cost[s]
                    w_done[s][m] = end
                free_at[d] = end
                i += 1
                remaining -= 1
                progressed = True
            next_idx[d] = i
        if not progressed:
            raise _deadlock(per_device, next_idx, num_stages)
    if ends is not None:
        ends.update({F: f_done, B: g_done, I: g_done, W: w_done, E: e_done})
    return max(t + o for t, o in zip(free_at, opt))


def _deadlock(per_device: list[list[Action]] | None, next_idx: list[int], num_stages: int) -> ValueError:
    """Name what each stuck device waits for. Devices run their lists in order, so what has
    finished is each list up to where its device stopped."""
    if per_device is None:
        return ValueError("schedule deadlocks")
    finished = {a for d, i in enumerate(next_idx) for a in per_device[d][:i]}
    scheduled = {a for actions in per_device for a in actions}
    one_each = all(a.stage_index == d for d, actions in enumerate(per_device) for a in actions)
    stuck = "; ".join(
        ("" if one_each else f"device {d} ") + f"stage {a.stage_index} {a.label} waits for "
        + ", ".join(f"stage {dep.stage_index} {dep.label}" for dep in _deps(num_stages, a, scheduled)
                    if dep not in finished)
        for d, i in enumerate(next_idx)
        if i < len(per_device[d]) and (a := per_device[d][i])
    )
    return ValueError(f"schedule deadlocks at {stuck}")
