"""Step reports joined into step records: one record once every stage has reported its step
(and, with evaluation in the bubbles, its held-out loss has come), or at a restart from the
reports that did arrive."""

from __future__ import annotations

from hetlaunch.launcher.part_rows import per_stage_rows
from hetlaunch.launcher.planning.topology import node_workers
from hetlaunch.launcher.run_record import StepRecord
from hetlaunch.protos import control_pb2 as pb


MAX_PENDING_STEPS = 4096  # steps some stage has reported and another not yet: a few in a real job


class StepAggregator:
    """Joins the per-stage reports of one step into one record once every stage has reported.

    With several pipelines the step's loss is the mean over all its micro-batches: each
    pipeline's mean weighted by its share, and its tokens are the pipelines' sum.

    With evaluation in the bubbles (runtime/step_evaluation.py) a last stage reports a step with
    `eval_follows` and sends its held-out loss later in a report of its own (`eval_only`): the
    step's record waits for it. `carried`: a record of the generation before whose held-out loss
    never came (the step meant to measure it failed); this generation's first step measures it
    (TrainSpec.eval_before_start), and its last stages' `eval_only` reports complete it.
    """

    def __init__(self, plan, carried: StepRecord | None = None):
        # node -> (pipeline, stage index): a step report names its node (several stages per node:
        # a node's worker reports once, as its position in the pipeline, with each stage's share)
        self.position = {node: (q.pipeline, q.stage) for node, q in
                         node_workers(plan, "joining step reports (a report names its node)").items()}
        last = {p: max(j for q, j in self.position.values() if q == p) for p, _ in self.position.values()}
        self.last_stages = {(p, j) for p, j in self.position.values() if j == last[p]}
        self.shares = plan.pipeline_microbatches
        self.islands = plan.islands
        self.pending: dict[int, dict[tuple[int, int], tuple[str, pb.StepMetrics]]] = {}
        self.late_evals: dict[int, dict[tuple[int, int], float | None]] = {}  # step -> last stage -> its loss
        self.carried = carried
        # The highest step recorded: a report of it or an earlier one is a copy (a client that sends
        # a report again after a timeout, where the first landed after all), never recorded twice.
        # Each stage reports its steps in order, so every report of a recorded step came before.
        self.recorded_through = -1

    def add(self, node: str, metrics: pb.StepMetrics) -> StepRecord | None:
        position = self.position.get(node)
        if position is None:  # a node this plan does not use (a spare that joined): a KeyError ended `up`
            return None
        if metrics.eval_only:
            if metrics.step not in self.late_evals and len(self.late_evals) >= MAX_PENDING_STEPS:
                return None  # bounded as pending is: evaluations of steps that never complete
            self.late_evals.setdefault(metrics.step, {})[position] = \
                metrics.eval_loss if metrics.has_eval_loss else None
            if self.carried is not None and metrics.step == self.carried.step:
                return self._complete_carried()
        else:
            if metrics.step <= self.recorded_through:
                return None
            if metrics.step not in self.pending and len(self.pending) >= MAX_PENDING_STEPS:
                # Steps no other stage reports (an agent counting its own) were held forever: 400,000
                # held 426 MB (a review). The furthest ahead goes: the steps under way are the lowest.
                furthest = max(self.pending)
                if metrics.step > furthest:
                    return None
                del self.pending[furthest]
            self.pending.setdefault(metrics.step, {})[position] = (node, metrics)
        return self._ready(metrics.step)

    def _ready(self, step: int) -> StepRecord | None:
        reports = self.pending.get(step, {})
        if len(reports) < len(self.position):
            return None
        awaited = {position for position, (_, m) in reports.items() if m.eval_follows}
        if not awaited <= self.late_evals.get(step, {}).keys():
            return None
        del self.pending[step]
        self.recorded_through = max(self.recorded_through, step)
        return self._record(step, reports)

    def _complete_carried(self) -> StepRecord | None:
        if not self.last_stages <= self.late_evals[self.carried.step].keys():
            return None
        record, self.carried = self.carried, None
        evals = [v for v in self.late_evals.pop(record.step).values() if v is not None]
        record.eval_loss = sum(evals) / len(evals) if evals else None
        record.eval_awaited = False
        return record

    def incomplete(self, before: int) -> list[StepRecord]:
        """Steps before `before` that some stage never reported (its node died after the step was
        taken, before its report arrived), recorded from the reports that did arrive: the loss of
        the pipelines whose last stage reported, and which nodes are missing. A record whose
        held-out loss never came is `eval_awaited`."""
        out = []
        for step in sorted(s for s in self.pending if s < before):
            reports = self.pending.pop(step)
            self.recorded_through = max(self.recorded_through, step)
            record = self._record(step, reports)
            record.missing = sorted(n for n, pos in self.position.items() if pos not in reports)
            record.eval_awaited = any(m.eval_follows for _, m in reports.values()) and record.eval_loss is None
            out.append(record)
        return out

    def _record(self, step: int, reports: dict) -> StepRecord:
        ordered = [(position, *reports[position]) for position in sorted(reports)]
        with_loss = {p for (p, _), _, m in ordered if m.has_loss}
        shares = sum(self.shares[p] for p in with_loss)
        loss = (sum(m.loss * self.shares[p] for (p, _), _, m in ordered if m.has_loss) / shares if shares
                else float("nan"))
        # Stages overlap in a pipeline and pipelines run side by side: the step takes as long as the slowest.
        step_s = max(m.step_s for _, _, m in ordered)
        tokens = sum(m.tokens for (_, j), _, m in ordered if j == 0)
        stages = [{"pipeline": p, "stage": j, "node": node, "step_s": round(m.step_s, 6),
                   "compute_s": round(m.compute_s, 6), "comm_s": round(m.comm_s, 6), "sync_s": round(m.sync_s, 6),
                   "sent_bytes": {"forward": [m.forward_raw_bytes, m.forward_wire_bytes],
                                  "backward": [m.backward_raw_bytes, m.backward_wire_bytes],
                                  "sync": [m.sync_raw_bytes, m.sync_wire_bytes]},
                   # the least transit of a message received from each neighbour, on its host's clock
                   "transit": {d: [round(t.seconds, 6), t.wire_bytes] for d, t in
                               (("from_prev", m.from_prev), ("from_next", m.from_next)) if m.HasField(d)},
                   # the stage's peak tensor memory so far, once measured (launcher/memory_summary.py)
                   **({"peak_bytes": {"activations": m.peak_activation_bytes, "used": m.peak_used_bytes}}
                      if m.peak_used_bytes else {})}
                  for (p, j), node, m in ordered]
        if any(m.parts for _, _, m in ordered):
            stages = per_stage_rows(stages, [m for _, _, m in ordered])
        evals = [m.eval_loss for _, _, m in ordered if m.has_eval_loss]  # one per pipeline, same weights
        evals += [v for v in self.late_evals.pop(step, {}).values() if v is not None]  # the bubbles' (eval_only)
        return StepRecord(step=step, loss=loss, tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
                          step_s=step_s, stages=stages, lr=ordered[0][2].lr or None,
                          grad_norm=max(m.grad_norm for _, _, m in ordered) or None,
                          eval_loss=sum(evals) / len(evals) if evals else None,
                          islands=self._islands(ordered) if self.islands else None)

    def _islands(self, ordered: list) -> dict:
        """Each island's loss (its pipelines' mean, weighted by share) and the step's outer exchanges."""
        losses = []
        for island in range(max(self.islands) + 1):
            mine = [(p, m) for (p, _), _, m in ordered if m.has_loss and self.islands[p] == island]
            shares = sum(self.shares[p] for p, _ in mine)
            losses.append(sum(m.loss * self.shares[p] for p, m in mine) / shares if shares else None)
        ms = [m for _, _, m in ordered]
        return {"losses": losses,
                "outer": {"launched": max(m.outer_launched for m in ms), "applied": max(m.outer_applied for m in ms),
                          "blocked_s": round(max(m.outer_s for m in ms), 6),
                          "bytes": [sum(m.outer_raw_bytes for m in ms), sum(m.outer_wire_bytes for m in ms)]}}
