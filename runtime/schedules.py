"""Pipeline schedules as data: one object per schedule, a registry keyed by name.

A schedule gives each stage the ordered list of typed actions (runtime/actions.py) it runs in
one training step; the executor walks its stage's list, and everything else (the dependency
simulation in runtime/simulation.py, the in-flight counts) checks a schedule without running a
model, in the style of ``torch/distributed/pipelining/schedules.py``.

The object also owns what follows from its order, so that no caller tests a schedule's name:

* ``in_flight``: how many micro-batches' activations a stage holds at most (its memory);
* ``closed_step`` / ``window_term``: its closed form, the step time the planner's search uses
  where simulating every candidate would be too slow (launcher/planning/cost_model.py). In
  terms of one stage's compute t_j per micro-batch (forward + backward), the time c_j one
  activation occupies its outgoing link and that link's latency lat_j, with T = max t_j,
  C = max c_j and the fill and drain sum_j t_j + sum_{j<S-1} 2 (lat_j + c_j) of one
  micro-batch down and back up the chain.

The planner imports nothing else of the runtime than this module and runtime/registry.py, so
the simulation and the several-stages-per-device schedules (runtime/device_schedules.py) are
re-exported here for it.
"""

from __future__ import annotations

import functools

from hetlaunch.runtime.actions import B, E, F, I, W, Action, Kind, max_in_flight, parse_actions, validate_actions
from hetlaunch.runtime.device_schedules import DEVICE_SCHEDULES, device_schedule_named, in_flight_by_device, timed_zb_v
from hetlaunch.runtime.fast_simulation import compiled_stage, simulate_in_order, simulate_stages, stage_order
from hetlaunch.runtime.simulation import (compiled, simulate, simulate_compiled, simulate_devices, simulated_timeline,
                                         split_backward)

__all__ = ["B", "E", "F", "I", "W", "Action", "Kind", "max_in_flight", "parse_actions", "validate_actions", "compiled",
           "compiled_stage", "simulate", "simulate_compiled", "simulate_stages", "simulate_in_order", "stage_order",
           "simulated_timeline", "Schedule", "OneFOneB", "GPipe", "SCHEDULES",
           "schedule_named", "schedule_for", "own_window", "one_f_one_b", "gpipe", "ZeroBubbleH1",
           "ZeroBubbleH2", "DEVICE_SCHEDULES", "device_schedule_named", "in_flight_by_device", "simulate_devices",
           "split_backward", "timed_zb_v"]


def _check_args(stage: int, num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}), got {stage}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


class Schedule:
    """A schedule: its action lists, its in-flight counts and, where it has one, its closed form."""

    name = ""
    title = ""  # how messages spell it
    deepens = False  # takes per-stage windows deeper than its own (more micro-batches in flight)
    one_bottleneck = False  # closed form depends on max(compute, link, window) only, not on each apart
    closed_form_exact = False  # closed form equals the simulation (so it bounds what a simulation prices)
    # Every stage runs each micro-batch once forward and once backward (no other kind of action)
    # and ends on a backward: the planner's floor reads that without building the lists.
    forward_backward_only = False

    def stage_actions(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> list[Action]:
        """Stage `stage`'s actions; `window` (0: the schedule's own) where the schedule deepens."""
        self._check(stage, num_stages, num_microbatches, window)
        return self._actions(stage, num_stages, num_microbatches, window)

    def _check(self, stage: int, num_stages: int, num_microbatches: int, window: int) -> None:
        _check_args(stage, num_stages, num_microbatches)
        if window and not self.deepens:
            windowed = ", ".join(s.name for s in SCHEDULES.values() if s.deepens)
            raise ValueError(f"a window is for {windowed} only, not {self.name}")

    def compiled_list(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> tuple | None:
        """compiled_stage(stage_actions(...)): the list simulate_stages runs (m for F(m), ~m for B(m)),
        or None where the schedule has other kinds of action. 1F1B and GPipe build it from integers:
        building Action tuples first was a third of planning a global batch of 4,096 (tens of
        millions of them, a list per window the search tries)."""
        return compiled_stage(self.stage_actions(stage, num_stages, num_microbatches, window), stage)

    def actions(self, num_stages: int, num_microbatches: int,
                windows: list[int] | tuple[int, ...] | None = None) -> list[list[Action]]:
        """Every stage's actions, stage j with windows[j] (0 or absent: its own)."""
        windows = windows or [0] * num_stages
        return [self.stage_actions(j, num_stages, num_microbatches, w) for j, w in enumerate(windows)]

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> int:
        """Most micro-batches stage `stage` holds in flight (max_in_flight of its actions)."""
        raise NotImplementedError

    def closed_step(self, num_microbatches: int, compute_max: float, link_max: float, sum_term: float,
                    window_max: float) -> float:
        """The step in closed form from T, C, the fill and drain and the largest window_term."""
        raise NotImplementedError(f"{self.name} has no closed form; price it by simulation")

    def window_term(self, round_trip: float, stage: int, num_stages: int, num_microbatches: int) -> float:
        """What a stage's in-flight window costs per micro-batch given its round trip to the end of
        the pipeline and back; 0 for schedules no window limits."""
        return 0.0

    def _actions(self, stage: int, num_stages: int, num_microbatches: int, window: int) -> list[Action]:
        raise NotImplementedError


def own_window(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches 1F1B itself keeps in flight at a stage: min(S - s, M)."""
    return min(num_stages - stage, num_microbatches)


class OneFOneB(Schedule):
    """PipeDream-flush 1F1B: warm-up forwards, then one forward / one backward, then drain.

    Stage ``s`` keeps at most ``min(num_stages - s, M)`` micro-batches' activations alive,
    which is the point of 1F1B over GPipe. A deeper ``window`` (micro-batches in flight, at
    least that default) runs more warm-up forwards, so more micro-batches are on their way
    over a slow link while the first gradient comes back, paid for in activation memory.
    Windows must not grow down the pipeline (stage s's >= stage s+1's); the planner and the
    YAML check (launcher/planning/plan.py check_windows).

    Closed form: forwards and backwards interleave, so activations and gradients use the two
    directions of a link at once and the steady state runs at the slowest resource,

        step = (M - 1) * max(T, C, max_j RT_j / w_j) + fill and drain,

    where stage j keeps w_j = min(S - j, M) micro-batches in flight and each must make the
    round trip to the end of the pipeline and back, RT_j = sum_{k>=j} t_k
    + sum_{k>=j, k<S-1} 2 (lat_k + c_k). Over a high-latency link that window, not compute or
    bandwidth, is what limits 1F1B.
    """

    name, title, deepens, one_bottleneck, forward_backward_only = "1f1b", "1F1B", True, True, True

    def _actions(self, stage: int, num_stages: int, num_microbatches: int, window: int) -> list[Action]:
        m_total = num_microbatches
        warmup = self._warmup(stage, num_stages, m_total, window)
        actions = [Action(stage, F, m) for m in range(warmup)]
        for i in range(m_total - warmup):
            actions += [Action(stage, F, warmup + i), Action(stage, B, i)]
        actions += [Action(stage, B, m) for m in range(m_total - warmup, m_total)]
        return actions

    def compiled_list(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> tuple:
        self._check(stage, num_stages, num_microbatches, window)
        return _one_f_one_b_list(self._warmup(stage, num_stages, num_microbatches, window), num_microbatches)

    @staticmethod
    def _warmup(stage: int, num_stages: int, m_total: int, window: int) -> int:
        if window:
            own = own_window(stage, num_stages, m_total)
            if window < own:
                raise ValueError(f"stage {stage}'s window {window} is below 1F1B's {own}")
            return min(window - 1, m_total)
        return min(num_stages - stage - 1, m_total)

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> int:
        return min(window, num_microbatches) if window else own_window(stage, num_stages, num_microbatches)

    def closed_step(self, num_microbatches: int, compute_max: float, link_max: float, sum_term: float,
                    window_max: float) -> float:
        return (num_microbatches - 1) * max(compute_max, link_max, window_max) + sum_term

    def window_term(self, round_trip: float, stage: int, num_stages: int, num_microbatches: int) -> float:
        # Stage j starts one micro-batch per round_trip / w_j: its window's worth per round trip.
        return round_trip / own_window(stage, num_stages, num_microbatches)


@functools.lru_cache(maxsize=64)  # a list at thousands of micro-batches holds megabytes of ints
def _one_f_one_b_list(warmup: int, m_total: int) -> tuple:
    """1F1B's integer list for a warm-up and micro-batch count, which is all it depends on: the
    planner asks for it for every stage of every chain and window it prices (the same few
    warm-ups each time), and at thousands of micro-batches building it was a tenth of planning."""
    # B(m) is ~m = -m - 1: the backwards are descending ranges of negatives
    steady = [0] * (2 * (m_total - warmup))
    steady[0::2] = range(warmup, m_total)  # F(warmup + i), then B(i)
    steady[1::2] = range(-1, -(m_total - warmup) - 1, -1)
    return (*range(warmup), *steady, *range(-(m_total - warmup) - 1, -m_total - 1, -1))


class GPipe(Schedule):
    """GPipe: all forwards, then all backwards, both in micro-batch order 0..M-1.

    Every stage uses the same backward order, so the backward wave flows down the pipeline
    like the forward one (``simulate`` proves it deadlock-free). Every stage holds all M
    micro-batches in flight.

    Closed form: each phase streams M micro-batches over a link in one direction, so a
    link-bound GPipe step takes twice a link-bound 1F1B step (backward taken as twice forward:
    profiles hold f + b),

        step = (M - 1) * (max(T/3, C) + max(2T/3, C)) + fill and drain.

    Without links it is 1F1B's (M - 1) T + fill and drain: the bubbles are equal, the memory is
    not. No window limits it.
    """

    name, title, forward_backward_only = "gpipe", "GPipe", True
    closed_form_exact = True  # each phase streams at its slowest resource; tests/planning/test_exact_pricing.py checks it

    def _actions(self, stage: int, num_stages: int, num_microbatches: int, window: int) -> list[Action]:
        return [Action(stage, F, m) for m in range(num_microbatches)] + \
            [Action(stage, B, m) for m in range(num_microbatches)]

    def compiled_list(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> tuple:
        self._check(stage, num_stages, num_microbatches, window)
        return (*range(num_microbatches), *(~m for m in range(num_microbatches)))

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> int:
        return num_microbatches

    def closed_step(self, num_microbatches: int, compute_max: float, link_max: float, sum_term: float,
                    window_max: float) -> float:
        return (num_microbatches - 1) * (max(compute_max / 3, link_max) + max(2 * compute_max / 3, link_max)) + sum_term


class ZeroBubbleH1(Schedule):
    """ZB-H1 (Zero Bubble Pipeline Parallelism, ICLR'24): 1F1B's order with each backward split
    into the input's gradient I, sent upstream at once, and the weights' W, held back.

    Stage ``s`` of ``S`` warms up with 1F1B's ``S - s - 1`` forwards, then runs F, I pairs (the
    forwards run out before the I's do), and gives each micro-batch's W ``s`` I's later: the last
    stage holds most back, and the W's it still owes at the end fill the time in which the
    gradients climb the pipeline as I's alone. Upstream stages wait only for I's, so with equal
    F, I and W the bubble is ``(S - 1) F`` against 1F1B's ``3 (S - 1) F``, and every stage holds
    at most ``min(S, M)`` micro-batches (from the forward to the W): 1F1B's peak, which only its
    first stage reaches there.

    Closed form, for the planner's search only (a plan's step is priced by simulation): the
    steady state runs at the slowest resource as 1F1B's does, and of the fill and drain about
    half is left (the forwards' way down; the I's way back up is mostly hidden behind held W's),

        step = (M - 1) * max(T, C, max_j RT_j / min(S, M)) + T + (fill and drain - T) / 2.

    Against the simulation over 300 random pipelines (2-6 stages, 4-16 micro-batches, links and
    latencies from none to five stage times) it is off by 7% on average (-32% to +23%); not
    exact, so the planner simulates the chains it can afford to and every plan it returns.
    """

    name, title = "zb-h1", "ZB-H1"

    def _actions(self, stage: int, num_stages: int, num_microbatches: int, window: int) -> list[Action]:
        m_total = num_microbatches
        warmup = min(num_stages - stage - 1, m_total)
        actions = [Action(stage, F, m) for m in range(warmup)]
        forwarded, held = warmup, []
        for m in range(m_total):
            if forwarded < m_total:
                actions.append(Action(stage, F, forwarded))
                forwarded += 1
            actions.append(Action(stage, I, m))
            held.append(m)
            if len(held) > stage:
                actions.append(Action(stage, W, held.pop(0)))
        return actions + [Action(stage, W, m) for m in held]

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> int:
        return min(num_stages, num_microbatches)

    def closed_step(self, num_microbatches: int, compute_max: float, link_max: float, sum_term: float,
                    window_max: float) -> float:
        return (num_microbatches - 1) * max(compute_max, link_max, window_max) + compute_max + \
            max(sum_term - compute_max, 0.0) / 2

    def window_term(self, round_trip: float, stage: int, num_stages: int, num_microbatches: int) -> float:
        return round_trip / min(num_stages, num_microbatches)


class ZeroBubbleH2(Schedule):
    """ZB-H2 (Zero Bubble Pipeline Parallelism, ICLR'24): ZB-H1 allowed more memory. More forwards
    in the warm-up fill the bubble before the first I, and W's held back to the tail fill the one
    after the last, so each stage is busy from its first forward to its last W: a parallelogram
    where ZB-H1's is a trapezoid.

    Stage ``s`` of ``S`` warms up with ``2 (S - s) - 1`` forwards (with equal F and I, what fits
    before its first gradient is back: an F on each stage down and an I on each stage up), then
    after each I runs the next forward, preceded by the oldest held W once it holds ``2S - 1``
    micro-batches (forward to W). When the forwards have run out it holds its last ``2s`` W's back
    to the end: while they run, the last gradient climbs to the first stage, which started s F
    earlier, an I a stage (``s + M - S`` where M is small, so that a short step never ends later
    than ZB-H1's).
    Every stage holds ``min(2S - 1, M)`` micro-batches: ``2S - 1`` against ZB-H1's ``S`` at every
    stage and 1F1B's ``S - s`` at stage s, the price of the deeper warm-up (the first stage) and
    of the held W's (the last).

    With M >= 2S - 1, equal F, I and W and free links, stage s runs its 3M F without a gap from
    s F to (3M + s) F (with fewer micro-batches there are too few forwards to fill the warm-up);
    the step simulated here (the last stage's end) is ZB-H1's (3M + S - 1) F all the
    same, since the last stage cannot start before the first forward reaches it. What the
    parallelogram saves, (S - 1) F per step, shows where steps run back to back with no barrier
    between the stages (stage 0 starts the next step while the last stage finishes this one: the
    paper's zero bubble; the planner prices one step, so it does not count it). What the
    simulation does count, with M >= 2S - 1: the window of ``2S - 1`` micro-batches hides a
    latency of up to an F per link, where ZB-H1's window of ``S`` waits for the round trip; and
    an I longer than a W (up to twice the shorter of F and W) leaves no bubble, where ZB-H1's
    grows by (S - 1)(I - W) (tests/stage/test_schedules.py).

    Closed form, for the planner's search only (a plan's step is priced by simulation): ZB-H1's,
    with the deeper window,

        step = (M - 1) * max(T, C, max_j RT_j / min(2S - 1, M)) + T + (fill and drain - T) / 2.

    Against the simulation over 300 random pipelines (2-6 stages, 4-16 micro-batches, per stage
    compute uniform, each boundary's link and latency uniform from none to five stage times) it
    is off by 15% on average (-36% to +7%; ZB-H1's closed form by 12%, -32% to +7%, on the same
    pipelines): below the simulation where links are slow, so the planner simulates the chains it
    can afford to and every plan it returns; tests/stage/test_typed_schedules.py measures it.
    """

    name, title = "zb-h2", "ZB-H2"

    def _actions(self, stage: int, num_stages: int, num_microbatches: int, window: int) -> list[Action]:
        m_total = num_microbatches
        most = self.in_flight(stage, num_stages, m_total)
        warmup = min(2 * (num_stages - stage) - 1, m_total)
        kept = min(2 * stage, stage + max(m_total - num_stages, 0))  # W's held back to the end
        actions = [Action(stage, F, m) for m in range(warmup)]
        forwarded, held = warmup, []
        for m in range(m_total):
            actions.append(Action(stage, I, m))
            held.append(m)
            if forwarded < m_total:
                if forwarded - (m + 1 - len(held)) >= most:  # forwarded less W's run: in flight
                    actions.append(Action(stage, W, held.pop(0)))
                actions.append(Action(stage, F, forwarded))
                forwarded += 1
            else:
                while len(held) > kept:
                    actions.append(Action(stage, W, held.pop(0)))
        return actions + [Action(stage, W, m) for m in held]

    def in_flight(self, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> int:
        return min(2 * num_stages - 1, num_microbatches)

    def closed_step(self, num_microbatches: int, compute_max: float, link_max: float, sum_term: float,
                    window_max: float) -> float:
        return (num_microbatches - 1) * max(compute_max, link_max, window_max) + compute_max + \
            max(sum_term - compute_max, 0.0) / 2

    def window_term(self, round_trip: float, stage: int, num_stages: int, num_microbatches: int) -> float:
        return round_trip / min(2 * num_stages - 1, num_microbatches)


# Keyed by the names runtime/registry.py SCHEDULE_NAMES spells (tests/stage/test_registry.py ties them).
SCHEDULES: dict[str, Schedule] = {s.name: s for s in (OneFOneB(), GPipe(), ZeroBubbleH1(), ZeroBubbleH2())}


def schedule_named(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}") from None


def schedule_for(name: str, stage: int, num_stages: int, num_microbatches: int, window: int = 0) -> list[Action]:
    """The stage's actions; `window` (1F1B only; 0: the default) deepens its warm-up."""
    return schedule_named(name).stage_actions(stage, num_stages, num_microbatches, window)


one_f_one_b = SCHEDULES["1f1b"].stage_actions
gpipe = SCHEDULES["gpipe"].stage_actions
