"""Evaluation in the bubbles: held-out forwards placed where the step's schedule leaves a stage idle.

A pipeline step has idle time its schedule cannot remove: a stage waits for its first activation,
for gradients over a slow link, for the drain. PipeFill (MLSys'25) fills such bubbles with other
work. Here the other work is the job's own evaluation: instead of running the held-out forwards
through the pipeline after the step (every stage busy with nothing else, the training stopped),
each stage runs its evaluation forwards (``E`` actions, runtime/actions.py) inside its idle time of
the next step, while the weights are still those the evaluation is due for (they change only at
the optimizer step, after every action).

Where the idle time is comes from the simulation of the step with the plan's costs
(runtime/simulation.py): each stage's gaps between actions. Stage by stage, held-out micro-batch
by micro-batch, an ``E`` goes into the first gap that starts late enough for its input (the
previous stage's ``E`` of it, over the link) and is long enough for it; one that fits nowhere
goes after the stage's last action, which is where evaluation after the step would have run. A
stage that never idles early enough (the first stage of a compute-bound 1F1B) would make every
later stage wait for its ``E``s at the end, so the same is also tried with the first stage's
``E``s in front of its first action: the downstream stages then fill their early idle time. The
placement with the shorter simulated step is kept. Every placement comes from one feasible
timeline, so the lists stay deadlock-free whatever the real durations (each dependency points
forward in that timeline), and the simulation checks them anyway.

A prediction can be early: the upstream stage ran late, and the E's input is not there when the
stage reaches it. The executor then does not wait for it: it keeps that E (and the ones after it,
in order) for the next E's place, or runs them after the stage's last training action
(runtime/executor.py). Only a sealed link cannot tell whether a message is there before opening
it; there an E waits as any receive does.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetlaunch.runtime.actions import E, Action
from hetlaunch.runtime.simulation import simulate, simulated_timeline


@dataclass(frozen=True)
class FillReport:
    step_s: float            # the step without evaluation, simulated
    step_with_eval_s: float  # the step with the E's where they were placed, simulated
    after_step_s: float      # the step, then evaluation through the pipeline after it (as before)
    idle_s: float            # the stages' idle time in the step without evaluation, summed
    filled_s: float          # evaluation time placed inside that idle time, summed over stages
    eval_s: float            # all evaluation time, summed over stages

    @property
    def filled_fraction(self) -> float:
        """How much of the stages' idle time evaluation fills."""
        return self.filled_s / self.idle_s if self.idle_s > 0 else 0.0


def fill_bubbles(per_stage: list[list[Action]], num_eval: int, forward_cost: list[float], backward_cost: list[float],
                 link_cost: list[float], latency: list[float], input_grad_cost: list[float] | None = None,
                 weight_grad_cost: list[float] | None = None,
                 eval_cost: list[float] | None = None) -> tuple[list[list[Action]], FillReport]:
    """Each stage's actions with `num_eval` evaluation forwards placed in its idle time, and what
    the placement is predicted to cost and fill (module docstring)."""
    if num_eval < 1:
        raise ValueError(f"num_eval must be >= 1, got {num_eval}")
    eval_cost = list(eval_cost or forward_cost)
    costs = (forward_cost, backward_cost, link_cost, latency, input_grad_cost, weight_grad_cost)
    timeline = simulated_timeline(per_stage, *costs)
    step = simulate(per_stage, *costs[:4], None, *costs[4:])
    idle = sum(_idle(spans, step) for spans in timeline)
    after = step + _after_step(len(per_stage), num_eval, eval_cost, link_cost, latency)
    best = None
    for front in (False, True):
        lists, filled = _placed(per_stage, timeline, num_eval, eval_cost, link_cost, latency, step, front)
        with_eval = simulate(lists, *costs[:4], None, *costs[4:], eval_cost)
        if best is None or with_eval < best[1]:
            best = (lists, with_eval, filled)
    lists, with_eval, filled = best
    return lists, FillReport(step_s=step, step_with_eval_s=with_eval, after_step_s=after, idle_s=idle,
                             filled_s=filled, eval_s=num_eval * sum(eval_cost))


def _idle(spans: list[tuple[Action, float, float]], step: float) -> float:
    busy = sum(end - start for _, start, end in spans)
    return max(step - busy, 0.0)


def _after_step(num_stages: int, num_eval: int, eval_cost: list[float], link_cost: list[float],
                latency: list[float]) -> float:
    """Evaluation through the pipeline with nothing else to do: the first micro-batch's way down,
    then the slowest stage (or link) for each further one."""
    down = sum(eval_cost) + sum(link_cost) + sum(latency)
    slowest = max(eval_cost + list(link_cost))
    return down + (num_eval - 1) * slowest


def _placed(per_stage, timeline, num_eval: int, eval_cost: list[float], link_cost: list[float],
            latency: list[float], step: float, front: bool) -> tuple[list[list[Action]], float]:
    """The E's placed stage by stage (module docstring); with `front`, the first stage's first."""
    lists, filled = [], 0.0
    arrive = [0.0] * num_eval  # when E(s - 1, k)'s activation reaches this stage
    for s, spans in enumerate(timeline):
        cost = eval_cost[s]
        # Gaps (start, end, insert before action i); the last runs to the step's end.
        gaps, previous_end = [], 0.0
        for i, (_, start, end) in enumerate(spans):
            gaps.append([previous_end, start, i])
            previous_end = end
        tail = previous_end
        gaps.append([previous_end, step, len(spans)])
        inserts: list[tuple[int, int]] = []  # (insert before action i, k), in placement order
        ends = []
        for k in range(num_eval):
            if s == 0 and front:
                at = ends[-1] if ends else 0.0
                inserts.append((0, k))
                ends.append(at + cost)
                continue
            for gap in gaps:  # in held-out order: the next link receives them in the order sent
                begin = max(gap[0], arrive[k], ends[-1] if ends else 0.0)
                if begin + cost <= gap[1] + 1e-12:
                    inserts.append((gap[2], k))
                    ends.append(begin + cost)
                    gap[0] = begin + cost
                    filled += cost
                    break
            else:  # after the stage's last action, where evaluation after the step would start
                begin = max(tail, arrive[k], ends[-1] if ends else 0.0)
                inserts.append((len(spans), k))
                ends.append(begin + cost)
        if s < len(timeline) - 1:
            arrive = [end + link_cost[s] + latency[s] for end in ends]
        actions: list[Action] = []  # E's go before the action they precede, in held-out order
        by_position: dict[int, list[int]] = {}
        for position, k in inserts:
            by_position.setdefault(position, []).append(k)
        for i, (action, _, _) in enumerate(spans):
            actions += [Action(s, E, k) for k in by_position.get(i, [])]
            actions.append(action)
        actions += [Action(s, E, k) for k in by_position.get(len(spans), [])]
        lists.append(actions)
    return lists, filled
