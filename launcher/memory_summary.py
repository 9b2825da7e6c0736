"""Per-stage memory in the run's summary: what the plan predicted beside what each stage measured.

Every stage measures its tensor memory (runtime/memory_limit.py) and reports its peak so far with
each step (StepMetrics.peak_activation_bytes, peak_used_bytes; in metrics.jsonl as a stage's
"peak_bytes"). The summary keeps, per stage of the final plan, the largest of those reports over
the run, beside the plan's prediction (StagePlan.memory_bytes: parameters, gradients, AdamW state
and the schedule's in-flight activations; None for a plan not made from a profile), and per
pipeline the memory balance: the first stage's peak activation bytes ÷ the last stage's (where a
node runs several stages, the first node's ÷ the last node's). Under 1F1B the first stage keeps up
to min(S, M) micro-batches' activations and the last one, so the figure says how unevenly the
schedule loads memory along the pipeline.

Measured is what autograd saved and the tensors in use (on a GPU the allocator's peak), never the
process's RSS: the interpreter, torch and the communication library are not in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetlaunch.launcher.planning.plan import Plan

if TYPE_CHECKING:  # run_record imports the live session (torch, grpc); the console side must not
    from hetlaunch.launcher.run_record import StepRecord


def stage_peaks(records: list[StepRecord]) -> dict[tuple[int, int, str], tuple[int, int]]:
    """(pipeline, stage, node) -> the largest (activation, used) peak bytes any step reported."""
    peaks: dict[tuple[int, int, str], tuple[int, int]] = {}
    for record in records:
        for stage in record.stages:
            measured = stage.get("peak_bytes")
            if not measured:
                continue
            key = (stage["pipeline"], stage["stage"], stage["node"])
            activations, used = peaks.get(key, (0, 0))
            peaks[key] = (max(activations, measured["activations"]), max(used, measured["used"]))
    return peaks


def memory_summary(plan: Plan, records: list[StepRecord]) -> dict:
    """The summary's "memory": per stage of `plan`, predicted and measured peak bytes (None where
    the plan predicts nothing or no step measured), and per pipeline the activation balance."""
    peaks = stage_peaks(records)
    stages, balance = [], []
    for p, pipeline in enumerate(plan.pipelines()):
        rows = []
        for j, stage in enumerate(pipeline):
            activations, used = peaks.get((p, j, stage.node), (None, None))
            rows.append({"pipeline": p, "stage": j, "node": stage.node, "layers": [stage.layer_start, stage.layer_end],
                         "predicted_bytes": stage.memory_bytes, "capacity_bytes": stage.capacity_bytes,
                         "peak_used_bytes": used, "peak_activation_bytes": activations})
        first, last = _ends(rows)
        balance.append(first / last if first is not None and last else None)
        stages.extend(rows)
    return {"stages": stages, "activation_balance": balance}


def _ends(rows: list[dict]) -> tuple[int | None, int | None]:
    """The peak activations at the pipeline's two ends: its first and last stage's, or, where a
    node runs several stages (interleaved 1F1B, ZB-V: it measures once, on its first stage's row),
    its first and last node's. ZB-V's first node holds the last stage too: the V-shape's claim is
    that its nodes' peaks are about equal, where 1F1B's first stage holds min(S, M) micro-batches
    against the last one's one."""
    nodes = list(dict.fromkeys(row["node"] for row in rows))
    if len(nodes) == len(rows):
        return rows[0]["peak_activation_bytes"], rows[-1]["peak_activation_bytes"]
    peak = {}
    for row in rows:
        if row["peak_activation_bytes"] is not None:
            peak.setdefault(row["node"], row["peak_activation_bytes"])
    return peak.get(nodes[0]), peak.get(nodes[-1])
