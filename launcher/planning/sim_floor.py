"""A step no event simulation of a cut can beat, whatever its windows: the planner's cheap test
before it simulates a cut at all (launcher/planning/chain_cuts.py, CostModel.deepen).

From the stages' action lists (runtime/schedules.py, compiled: (kind, micro-batch, stage)) it
takes only what every window vector keeps: how many actions of each kind a stage runs, and
whether its last action sends a gradient up. Then, with f, b, i, w the per-action costs, c the
link time and lat the latency of each boundary, for every stage j:

* it starts no sooner than the first activation has been computed and sent by every stage
  before it: before_j = sum_{k<j} (f_k + c_k + lat_k);
* it is busy for all its actions: work_j = nF f_j + nB b_j + nI i_j + nW w_j, then its
  optimizer runs;
* where its last action sends a gradient, every stage k before it still has to receive it
  and run its own gradient action g_k (B, or I where the schedule splits the backward) of
  that micro-batch, then its optimizer;
* the link after it carries M activations one at a time, the first no sooner than
  before_j + f_j; the last one still has to be computed forward and backward by the next
  stage, and its gradient sent back up to stage 0.

Sharper than "M t_j plus the links' crossing" by the pipeline's fill and drain, which is
about the whole bubble of a balanced cut: most cuts are then ruled out unsimulated.
"""

from __future__ import annotations

F_CODE, B_CODE, I_CODE, W_CODE = 0, 1, 2, 3


def stage_shapes(actions: tuple) -> list[tuple[int, int, int, int, bool]]:
    """Per stage: (forwards, backwards, input gradients, weight gradients, last action sends a gradient)."""
    shapes = []
    for stage_actions in actions:
        counts = [0, 0, 0, 0, 0]
        for kind, _, _ in stage_actions:
            counts[kind] += 1
        last = stage_actions[-1][0] if stage_actions else F_CODE
        shapes.append((counts[F_CODE], counts[B_CODE], counts[I_CODE], counts[W_CODE], last in (B_CODE, I_CODE)))
    return shapes


def simulation_floor(shapes: list[tuple[int, int, int, int, bool]], stages) -> float:
    """The floor above for stages (StageCost: forward_s, backward_s, input_grad_s, weight_grad_s,
    optimizer_s, link_s, latency_s) run by actions of these shapes."""
    split = all(s.input_grad_s + s.weight_grad_s > 0 for s in stages)  # as the simulation splits a backward
    return floor_of(shapes, [s.forward_s for s in stages], [s.backward_s for s in stages],
                    [s.input_grad_s if split else s.backward_s / 2 for s in stages],
                    [s.weight_grad_s if split else s.backward_s / 2 for s in stages],
                    [s.optimizer_s for s in stages], [s.link_s for s in stages], [s.latency_s for s in stages])


def floor_of(shapes: list[tuple[int, int, int, int, bool]], f: list[float], b: list[float], i: list[float],
             w: list[float], opt: list[float], link: list[float], latency: list[float]) -> float:
    """simulation_floor from per-stage lists: forward, backward, input and weight gradient,
    optimizer, outgoing link and its latency (0 on the last stage). The search reads the floors
    of thousands of cuts it never builds (CostModel.cut_floor)."""
    S = len(f)
    hop = [link[j] + latency[j] for j in range(S)]
    grad = [i[j] if shapes[j][2] else b[j] for j in range(S)]  # the action whose end sends the gradient up
    # drain[j]: from the end of stage j's gradient action to the end of the step, at least
    # (the gradient crosses every boundary before j, each stage runs its gradient action, then
    # the latest of their optimizers); drain[0] is stage 0's optimizer.
    drain = [opt[0]] * S
    for j in range(1, S):
        up_to = 0.0
        best = opt[j]  # nothing before it but its own optimizer, where it sends nothing
        for k in range(j - 1, -1, -1):
            up_to += hop[k] + grad[k]
            best = max(best, up_to + opt[k])
        drain[j] = best
    floor, before = 0.0, 0.0
    for j in range(S):
        nf, nb, ni, nw, sends = shapes[j]
        end = before + nf * f[j] + nb * b[j] + ni * i[j] + nw * w[j]
        floor = max(floor, end + (drain[j] if sends and j > 0 else opt[j]))
        if j < S - 1:
            # The last activation on link j reaches stage j + 1, is computed forward and back
            # there, and its gradient goes back up to stage 0.
            last_in = before + f[j] + nf * link[j] + latency[j]
            floor = max(floor, last_in + f[j + 1] + grad[j + 1] + hop[j] + grad[j] + drain[j])
        before += f[j] + hop[j]
    return floor
