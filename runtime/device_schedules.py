"""Schedules where a device holds several stages: interleaved 1F1B and ZB-V, as data.

A pipeline of ``D`` devices is cut into ``v·D`` stages, and each device runs the actions of the
``v`` stages it holds, in one list (runtime/actions.py: an action names its stage). Where the
stages sit is the schedule's *placement*:

* **looping** (interleaved 1F1B, Megatron-LM's "virtual pipeline"): stage ``s`` on device
  ``s mod D``. Micro-batches go round the devices ``v`` times, so the fill and drain of one
  round is a ``v``-th of a stage's work: the bubble shrinks ``v``-fold, for ``v`` times the
  messages between devices, one of which closes the loop from the last device to the first.
* **V-shape** (ZB-V, Qi et al., "Zero Bubble Pipeline Parallelism", ICLR'24, and the
  controllable-memory schedules, NeurIPS'24): ``v = 2``, stage ``s < D`` on device ``s`` and
  stage ``s >= D`` on device ``2D - 1 - s``. The first device holds the first and the last
  stage; the last device holds the two middle ones and hands the activation from one to the
  other without a link. Every device then holds about the same activations: 1F1B's first stage
  holds ``D`` micro-batches and its last one, the V-shape's devices about ``2D`` half-stages each.

The executor walks a device's list exactly as it walks one stage's (runtime/executor.py), and
`simulation.simulate_devices` prices and checks it (dependencies, no deadlock, in-flight counts)
without a model, as for the one-stage schedules of runtime/schedules.py.

ZB-V's order is not written out by hand: as the paper's own scheduler does, it is built by a
greedy list scheduler at unit costs (F = I = W = 1, free links) under a memory cap of ``2D``
half-stage activations per device, 1F1B's peak: a free device runs the input gradient that is
ready (what the device upstream waits for), else a forward while under the cap, else a held
weight gradient. The order it produces is then fixed data, priced with the real costs by the
simulation like any other schedule. `timed_zb_v` builds the same way at the stages' real costs
(links and latency included); the planner runs whichever of the two simulates faster for its cut,
and ships the timed one to the nodes (launcher/planning/device_plans.py).
"""

from __future__ import annotations

from hetlaunch.runtime.actions import B, F, I, W, Action, max_in_flight, parse_device_actions, validate_actions

__all__ = ["DeviceSchedule", "Interleaved1F1B", "ZeroBubbleV", "DEVICE_SCHEDULES", "device_schedule_named",
           "in_flight_by_device", "reordered", "timed_zb_v"]


class DeviceSchedule:
    """A schedule over devices that hold `stages_per_device` stages each."""

    name = ""
    title = ""
    stages_per_device = 2

    def num_stages(self, num_devices: int) -> int:
        return self.stages_per_device * num_devices

    def stage_device(self, stage: int, num_devices: int) -> int:
        """The device (position in the pipeline) that holds stage `stage`."""
        raise NotImplementedError

    def device_stages(self, device: int, num_devices: int) -> list[int]:
        """The stages device `device` holds, in pipeline order."""
        return [s for s in range(self.num_stages(num_devices)) if self.stage_device(s, num_devices) == device]

    def actions(self, num_devices: int, num_microbatches: int) -> list[list[Action]]:
        """Each device's actions in the order it runs them."""
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        return self._actions(num_devices, num_microbatches)

    def _actions(self, num_devices: int, num_microbatches: int) -> list[list[Action]]:
        raise NotImplementedError


class Interleaved1F1B(DeviceSchedule):
    """Megatron-LM's interleaved 1F1B over a looping placement.

    Device ``d`` walks its forwards in rounds of ``D`` micro-batches, chunk by chunk (chunk ``c``
    is stage ``c·D + d``): micro-batches 0..D-1 through chunk 0, then the same through chunk 1,
    and so on, then the next ``D`` micro-batches. Backwards go the same way with the chunks in
    reverse. It warms up with ``2 (D - d - 1) + (v - 1) D`` forwards, then alternates one forward
    and one backward, then drains. The rounds need ``M`` to be a multiple of ``D``.
    """

    name, title = "interleaved-1f1b", "interleaved 1F1B"

    def __init__(self, stages_per_device: int = 2):
        if stages_per_device < 1:
            raise ValueError(f"stages_per_device must be >= 1, got {stages_per_device}")
        self.stages_per_device = stages_per_device

    def stage_device(self, stage: int, num_devices: int) -> int:
        return stage % num_devices

    def _actions(self, num_devices: int, num_microbatches: int) -> list[list[Action]]:
        D, M, v = num_devices, num_microbatches, self.stages_per_device
        if M % D:
            raise ValueError(f"{self.title} runs micro-batches in rounds of the pipeline's {D} devices: "
                             f"{M} micro-batches is not a multiple of {D}")

        def nth(k: int, d: int, kind) -> Action:
            group, r = divmod(k, D * v)
            chunk = r // D if kind is F else v - 1 - r // D
            return Action(chunk * D + d, kind, group * D + r % D)

        per_device = []
        for d in range(D):
            total = M * v
            warmup = min(2 * (D - d - 1) + (v - 1) * D, total)
            actions = [nth(k, d, F) for k in range(warmup)]
            for k in range(total - warmup):
                actions += [nth(warmup + k, d, F), nth(k, d, B)]
            actions += [nth(k, d, B) for k in range(total - warmup, total)]
            per_device.append(actions)
        return per_device


class ZeroBubbleV(DeviceSchedule):
    """ZB-V: two stages per device in a V, the backward split into I and W, built greedily at unit
    costs under 1F1B's memory (module docstring)."""

    name, title, stages_per_device = "zb-v", "ZB-V", 2

    def stage_device(self, stage: int, num_devices: int) -> int:
        return stage if stage < num_devices else 2 * num_devices - 1 - stage

    def memory_cap(self, num_devices: int) -> int:
        """Half-stage activations a device may hold: 2D, what 1F1B's first stage holds in layers."""
        return 2 * num_devices

    def _actions(self, num_devices: int, num_microbatches: int) -> list[list[Action]]:
        D, M = num_devices, num_microbatches
        S, cap = 2 * D, self.memory_cap(D)
        done: dict[Action, int] = {}  # action -> the unit time it ends
        forwarded = [0] * S  # next micro-batch each stage forwards
        held: list[list[Action]] = [[] for _ in range(D)]  # I's done whose W is owed, oldest first
        live = [0] * D  # half-stage activations held: forwarded, weight gradients not yet done
        # per stage: every micro-batch below this has its input gradient done (_pick looks from there:
        # from 0 each time, 1,024 micro-batches built 21 million candidates, 17 of a plan's 24 s)
        lowest = [0] * S
        per_device: list[list[Action]] = [[] for _ in range(D)]
        stages = [self.device_stages(d, D) for d in range(D)]
        total, t = 3 * S * M, 0
        while len(done) < total:
            started = []
            for d in range(D):
                if per_device[d] and done[per_device[d][-1]] > t:
                    continue  # busy until its last action ends
                action = self._pick(d, stages[d], t, done, forwarded, lowest, held[d], live[d] < cap, S, M)
                if action is not None:
                    started.append((d, action))
            if not started and not any(done[a[-1]] > t for a in per_device if a):
                raise RuntimeError(f"ZB-V's greedy builder is stuck at t={t} (D={D}, M={M})")
            for d, action in started:
                per_device[d].append(action)
                done[action] = t + 1
                if action.kind is F:
                    forwarded[action.stage_index] += 1
                    live[d] += 1
                elif action.kind is I:
                    held[d].append(Action(action.stage_index, W, action.microbatch))
                    s = action.stage_index
                    while Action(s, I, lowest[s]) in done:
                        lowest[s] += 1
                else:
                    held[d].remove(action)
                    live[d] -= 1
            t += 1
        return per_device

    @staticmethod
    def _pick(d: int, stages: list[int], t: int, done: dict[Action, int], forwarded: list[int], lowest: list[int],
              held: list[Action], room: bool, S: int, M: int) -> Action | None:
        def ready(a: Action) -> bool:
            return a in done and done[a] <= t
        # The input gradient upstream waits for: oldest micro-batch first, then the later stage.
        inputs = [Action(s, I, m) for s in stages for m in range(lowest[s], forwarded[s])
                  if Action(s, I, m) not in done and ready(Action(s, F, m))
                  and (s == S - 1 or ready(Action(s + 1, I, m)))]
        if inputs:
            return min(inputs, key=lambda a: (a.microbatch, -a.stage_index))
        if room:  # the deeper stage first: its activation is nearer the loss
            for s in sorted(stages, reverse=True):
                m = forwarded[s]
                if m < M and (s == 0 or ready(Action(s - 1, F, m))):
                    return Action(s, F, m)
        return held[0] if held else None


def timed_zb_v(num_devices: int, num_microbatches: int, forward: list[float], input_grad: list[float],
               weight_grad: list[float], wire: list[float]) -> list[list[Action]]:
    """ZB-V's order built at the stages' own costs: what the unit-cost builder does when a
    forward, an input gradient and a weight gradient take the same time and links are free, here
    with each stage's F, I and W and each boundary's time on the wire (`wire[j]`: transfer plus
    latency from stage j to j + 1; 0 inside a device). Each device, once free, starts what can start
    soonest; among what can start at the same moment an input gradient first (oldest micro-batch,
    then the later stage), then a forward (the deeper stage), then the oldest held weight gradient.
    A device holds at most 2D half-stage activations, 1F1B's peak, as the unit builder; a forward
    of the V's first leg leaves the last place to the second (else every device could fill with
    first-leg activations that wait for a second-leg one nobody has room for).

    Where a link's latency is a good part of a forward, or F, I and W differ, the unit order leaves
    devices waiting: on the zero_bubble bench's 4 nodes with 20 ms links at 4 micro-batches it is
    priced 3.52 s a step, this order 3.11 s (tests/stage/test_device_schedules.py). RuntimeError if
    it cannot go on (not seen; the planner then keeps the unit order)."""
    D, M, S = num_devices, num_microbatches, 2 * num_devices
    if len(forward) != S or len(input_grad) != S or len(weight_grad) != S or len(wire) != S - 1:
        raise ValueError(f"ZB-V on {D} devices needs {S} stage costs and {S - 1} boundaries")
    placed = ZeroBubbleV()
    cap = placed.memory_cap(D)
    stages = [placed.device_stages(d, D) for d in range(D)]
    forward_end: dict[tuple[int, int], float] = {}
    input_end: dict[tuple[int, int], float] = {}
    forwarded, input_next = [0] * S, [0] * S  # per stage: next micro-batch to forward, to input-gradient
    held: list[list[Action]] = [[] for _ in range(D)]
    live, free = [0] * D, [0.0] * D
    per_device: list[list[Action]] = [[] for _ in range(D)]

    def forward_ready(s: int, m: int) -> float | None:
        if s == 0:
            return 0.0
        done = forward_end.get((s - 1, m))
        return None if done is None else done + wire[s - 1]

    def input_ready(s: int, m: int) -> float | None:
        done = forward_end.get((s, m))
        if done is None or s == S - 1:
            return done
        later = input_end.get((s + 1, m))
        return None if later is None else max(done, later + wire[s])

    def pick(d: int) -> tuple | None:
        """(start, rank..., action) of what device d would start next."""
        options = []
        for s in stages[d]:
            m = input_next[s]
            if m < forwarded[s] and (ready := input_ready(s, m)) is not None:
                options.append((max(ready, free[d]), 0, m, -s, Action(s, I, m)))
            m = forwarded[s]
            if m < M and live[d] < (cap if s >= D else cap - 1) and (ready := forward_ready(s, m)) is not None:
                options.append((max(ready, free[d]), 1, -s, 0, Action(s, F, m)))
        if held[d]:
            options.append((free[d], 2, 0, 0, held[d][0]))
        return min(options, key=lambda o: o[:4]) if options else None

    for _ in range(3 * S * M):
        picks = [(p, d) for d in range(D) if (p := pick(d)) is not None]
        if not picks:
            raise RuntimeError(f"ZB-V's timed builder is stuck (D={D}, M={M})")
        (start, *_, action), d = min(picks, key=lambda pd: (pd[0][0], pd[1]))
        s, m = action.stage_index, action.microbatch
        cost = (forward if action.kind is F else input_grad if action.kind is I else weight_grad)[s]
        free[d] = start + cost
        per_device[d].append(action)
        if action.kind is F:
            forward_end[s, m] = free[d]
            forwarded[s] += 1
            live[d] += 1
        elif action.kind is I:
            input_end[s, m] = free[d]
            input_next[s] += 1
            held[d].append(Action(s, W, m))
        else:
            held[d].remove(action)
            live[d] -= 1
    return per_device


def reordered(own: list[Action], order: str, num_microbatches: int) -> list[Action]:
    """A device's actions in the planner's `order` (StageSpec.device_order, "0F0 3F0 3I0 ..."):
    ValueError unless they are exactly `own`, the schedule's, in another order that keeps each
    stage's own rules (a forward before its gradients, an I before its W). The planner priced it;
    this only makes sure a wrong one fails at once rather than training on other work."""
    given = parse_device_actions(order)
    if sorted(given) != sorted(own):
        raise ValueError(f"the planned order of this node's actions ({len(given)}) is not a reordering of its "
                         f"schedule's ({len(own)})")
    for stage in sorted({a.stage_index for a in own}):
        validate_actions([a for a in given if a.stage_index == stage], num_microbatches, stage)
    return given


def in_flight_by_device(per_device: list[list[Action]]) -> list[int]:
    """Most stage activations each device holds at once (a forward until its B or W)."""
    return [max_in_flight(actions) for actions in per_device]


DEVICE_SCHEDULES: dict[str, DeviceSchedule] = {s.name: s for s in (Interleaved1F1B(), ZeroBubbleV())}


def device_schedule_named(name: str) -> DeviceSchedule:
    try:
        return DEVICE_SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r} for several stages per device; valid: "
                         f"{', '.join(DEVICE_SCHEDULES)}") from None
