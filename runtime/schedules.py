"""Pipeline schedules as data.

A schedule is, for each stage, the ordered list of actions that stage runs in
one training step: ``F m`` (forward micro-batch ``m``) or ``B m`` (backward).
The executor walks its stage's list; everything else here (the dependency
simulator, the in-flight count) checks a schedule without running a model, in
the style of ``torch/distributed/pipelining/schedules.py``.

Dependencies between stages (what P2P send/recv enforces at run time):
``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` needs ``F(s, m)`` and ``B(s+1, m)``
(the last stage's backward needs only its own forward, which computed the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable


class Op(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op.value}{self.microbatch}"


def _check_args(stage: int, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _f(m: int) -> Action:
    return Action(Op.FORWARD, m)


def _b(m: int) -> Action:
    return Action(Op.BACKWARD, m)


def own_window(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches 1F1B itself keeps in flight at a stage: min(S - s, M)."""
    return min(num_stages - stage, num_microbatches)


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> list[Action]:
    """PipeDream-flush 1F1B: warm-up forwards, then one forward / one backward, then drain.

    Stage ``s`` keeps at most ``min(num_stages - s, M)`` micro-batches' activations alive,
    which is the point of 1F1B over GPipe. A deeper ``window`` (micro-batches in flight, at
    least that default) runs more warm-up forwards, so more micro-batches are on their way
    over a slow link while the first gradient comes back, paid for in activation memory.
    Windows must not grow down the pipeline (stage s's >= stage s+1's); the planner and the
    YAML check (launcher/planning/plan.py check_windows).
    """
    _check_args(stage, num_stages, num_microbatches)
    m_total = num_microbatches
    warmup = min(num_stages - stage - 1, m_total)
    if window:
        own = own_window(stage, num_stages, m_total)
        if window < own:
            raise ValueError(f"stage {stage}'s window {window} is below 1F1B's {own}")
        warmup = min(window - 1, m_total)
    actions = [_f(m) for m in range(warmup)]
    for i in range(m_total - warmup):
        actions += [_f(warmup + i), _b(i)]
    actions += [_b(m) for m in range(m_total - warmup, m_total)]
    return actions


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """GPipe: all forwards, then all backwards, both in micro-batch order 0..M-1.

    Every stage uses the same backward order, so the backward wave flows down the
    pipeline like the forward one (``simulate`` proves it deadlock-free).
    """
    _check_args(stage, num_stages, num_microbatches)
    return [_f(m) for m in range(num_microbatches)] + [_b(m) for m in range(num_microbatches)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"1f1b": one_f_one_b, "gpipe": gpipe}


def schedule_for(name: str, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> list[Action]:
    """The stage's actions; `window` (1F1B only; 0: the default) deepens its warm-up."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}")
    if window and name != "1f1b":
        raise ValueError(f"a window is for 1f1b only, not {name}")
    return one_f_one_b(stage, num_stages, num_microbatches, window) if window else \
        SCHEDULES[name](stage, num_stages, num_microbatches)


def validate_actions(actions: list[Action], num_microbatches: int) -> None:
    """Raise ValueError unless each micro-batch is forwarded once and backwarded once, after its forward."""
    seen: set[Action] = set()
    for pos, a in enumerate(actions):
        if not 0 <= a.microbatch < num_microbatches:
            raise ValueError(f"action {a} at position {pos}: micro-batch outside [0, {num_microbatches})")
        if a in seen:
            raise ValueError(f"action {a} at position {pos} appears twice")
        if a.op is Op.BACKWARD and _f(a.microbatch) not in seen:
            raise ValueError(f"action {a} at position {pos} comes before its forward")
        seen.add(a)
    missing = [str(a) for m in range(num_microbatches) for a in (_f(m), _b(m)) if a not in seen]
    if missing:
        raise ValueError(f"schedule is missing actions: {' '.join(missing)}")


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point (activation memory)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.op is Op.FORWARD else -1
        peak = max(peak, live)
    return peak


def _deps(stage: int, num_stages: int, a: Action) -> list[tuple[int, Action]]:
    """(stage, action) pairs that must finish before ``a`` may start on ``stage``."""
    if a.op is Op.FORWARD:
        return [(stage - 1, a)] if stage > 0 else []
    deps = [(stage, _f(a.microbatch))]
    if stage < num_stages - 1:
        deps.append((stage + 1, a))
    return deps


def _costs(costs: list[float] | None, default: float, num_stages: int, what: str) -> list[float]:
    if costs is None:
        return [default] * num_stages
    if len(costs) != num_stages or any(c < 0 for c in costs):
        raise ValueError(f"{what} needs {num_stages} non-negative per-stage costs, got {costs}")
    return list(costs)


def simulate(
    per_stage: list[list[Action]],
    forward_cost: list[float] | None = None,
    backward_cost: list[float] | None = None,
    link_cost: list[float] | None = None,
    latency: list[float] | None = None,
    optimizer_cost: list[float] | None = None,
) -> float:
    """Run the per-stage action lists under the pipeline dependencies, each stage strictly in
    its own order; return the step's makespan. The step time the planner prices.

    Communication is what the executor does (runtime/executor.py, runtime/link.py): a stage
    sends its result asynchronously the moment an action ends and goes on; boundary ``j``
    (between stages j and j+1) carries each message for ``link_cost[j]`` seconds, one message
    after another in each direction (activations down, gradients up: a full-duplex link), and
    the message arrives ``latency[j]`` after it left the wire; a stage blocks only when the
    action it is at needs a message that has not arrived. After its last action a stage steps
    its optimizer (``optimizer_cost``). Default: free links, no optimizer.

    Raises ``ValueError("schedule deadlocks at ...")`` when no stage can progress.
    """
    num_stages = len(per_stage)
    if num_stages == 0:
        raise ValueError("simulate needs at least one stage")
    f_cost = _costs(forward_cost, 1.0, num_stages, "forward_cost")
    b_cost = _costs(backward_cost, 2.0, num_stages, "backward_cost")
    wire = _costs(link_cost, 0.0, num_stages - 1, "link_cost")
    lat = _costs(latency, 0.0, num_stages - 1, "latency")
    opt = _costs(optimizer_cost, 0.0, num_stages, "optimizer_cost")
    for s, actions in enumerate(per_stage):
        if len(set(actions)) != len(actions):
            raise ValueError(f"stage {s} repeats an action: {' '.join(map(str, actions))}")
    num_mb = 1 + max((a.microbatch for actions in per_stage for a in actions), default=0)
    return _simulate(compiled(per_stage), f_cost, b_cost, wire, lat, opt, per_stage, num_mb)


def compiled(per_stage: list[list[Action]]) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """The action lists as (is forward, micro-batch) pairs: what `simulate` walks. The planner
    keeps these per stage shape and simulates thousands of candidates with `simulate_compiled`."""
    return tuple(tuple((a.op is Op.FORWARD, a.microbatch) for a in actions) for actions in per_stage)


def simulate_compiled(plan, forward_cost: list[float], backward_cost: list[float], link_cost: list[float],
                      latency: list[float], optimizer_cost: list[float]) -> float:
    """`simulate` on `compiled` action lists, costs given in full (no defaults, no checks)."""
    # Well formed (schedule_for's): each stage runs the forward and the backward of every micro-batch.
    return _simulate(plan, forward_cost, backward_cost, link_cost, latency, optimizer_cost, None, len(plan[0]) // 2)


def simulated_timeline(per_stage: list[list[Action]], forward_cost: list[float], backward_cost: list[float],
                       link_cost: list[float], latency: list[float]) -> list[list[tuple[Action, float, float]]]:
    """`simulate`'s schedule as (action, start, end) per stage, from the step's start: the
    predicted timeline a trace shows beside the measured one."""
    ends: dict = {}
    _simulate(compiled(per_stage), forward_cost, backward_cost, link_cost, latency, [0.0] * len(per_stage),
              per_stage, 1 + max(a.microbatch for actions in per_stage for a in actions), ends)
    costs = {Op.FORWARD: forward_cost, Op.BACKWARD: backward_cost}
    done = {Op.FORWARD: ends["forward"], Op.BACKWARD: ends["backward"]}
    return [[(a, done[a.op][s][a.microbatch] - costs[a.op][s], done[a.op][s][a.microbatch]) for a in actions]
            for s, actions in enumerate(per_stage)]


def _simulate(plan, f_cost, b_cost, wire, lat, opt, per_stage, num_mb: int, ends: dict | None = None) -> float:
    num_stages = len(plan)
    # Plain lists indexed [stage][micro-batch]: the planner simulates thousands of candidates.
    f_done = [[None] * num_mb for _ in range(num_stages)]
    b_done = [[None] * num_mb for _ in range(num_stages)]
    f_in = [[None] * num_mb for _ in range(num_stages)]  # when an activation has arrived at stage s
    b_in = [[None] * num_mb for _ in range(num_stages)]  # when a gradient has arrived at stage s
    down_free = [0.0] * max(num_stages - 1, 0)  # each boundary's wire, activations going down
    up_free = [0.0] * max(num_stages - 1, 0)  # and gradients going up
    last = num_stages - 1
    next_idx = [0] * num_stages
    free_at = [0.0] * num_stages
    remaining = sum(len(a) for a in plan)
    while remaining:
        progressed = False
        for s in range(num_stages):
            # Run as far as this stage can go; a start time depends only on finished
            # actions, so the sweep order does not change the result.
            actions, i = plan[s], next_idx[s]
            while i < len(actions):
                forward, m = actions[i]
                if forward:
                    ready = 0.0 if s == 0 else f_in[s][m]
                    if ready is None:
                        break
                    end = (ready if ready > free_at[s] else free_at[s]) + f_cost[s]
                    f_done[s][m] = end
                    if s < last:  # the activation leaves now, behind what is still on the wire
                        leaves = end if end > down_free[s] else down_free[s]
                        down_free[s] = leaves + wire[s]
                        f_in[s + 1][m] = leaves + wire[s] + lat[s]
                else:
                    ready = f_done[s][m]
                    if ready is None:
                        break
                    if s < last:
                        grad = b_in[s][m]
                        if grad is None:
                            break
                        ready = grad if grad > ready else ready
                    end = (ready if ready > free_at[s] else free_at[s]) + b_cost[s]
                    b_done[s][m] = end
                    if s > 0:
                        leaves = end if end > up_free[s - 1] else up_free[s - 1]
                        up_free[s - 1] = leaves + wire[s - 1]
                        b_in[s - 1][m] = leaves + wire[s - 1] + lat[s - 1]
                free_at[s] = end
                i += 1
                remaining -= 1
                progressed = True
            next_idx[s] = i
        if not progressed:
            if per_stage is None:
                raise ValueError("schedule deadlocks")
            finished = {(s, Action(Op.FORWARD if f else Op.BACKWARD, m))
                        for s in range(num_stages) for f, done in ((True, f_done[s]), (False, b_done[s]))
                        for m in range(num_mb) if done[m] is not None}
            stuck = "; ".join(
                f"stage {s} {per_stage[s][i]} waits for "
                + ", ".join(f"stage {ds} {da}" for ds, da in _deps(s, num_stages, per_stage[s][i]) if (ds, da) not in finished)
                for s, i in enumerate(next_idx)
                if i < len(per_stage[s])
            )
            raise ValueError(f"schedule deadlocks at {stuck}")
    if ends is not None:
        ends.update(forward=f_done, backward=b_done)
    return max(t + o for t, o in zip(free_at, opt))
