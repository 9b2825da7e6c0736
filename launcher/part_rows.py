"""A step record's rows for nodes that run several stages (interleaved 1F1B, ZB-V): one per stage.

Such a node's worker reports once a step (runtime/device_stage_command.py) with each of its
stages' share in StepMetrics.parts; metrics.jsonl and the summary list stages, so the node's
row becomes one row per stage here (launcher/run_record.py StepAggregator).
"""

from __future__ import annotations

from hetlaunch.protos import control_pb2 as pb


def per_stage_rows(rows: list[dict], reports: list[pb.StepMetrics]) -> list[dict]:
    """Nodes running several stages report once a step with each stage's share (StepMetrics.parts):
    a row per stage, in pipeline order, keyed by the stage's own index so a node's two stages never
    collide. A stage's compute and bytes sent are its own; step, wait and sync times are its node's;
    the node's peak memory goes on its first stage's row (it is measured once for all of them)."""
    out = []
    for row, m in zip(rows, reports):
        if not m.parts:
            out.append(row)
            continue
        for k, part in enumerate(m.parts):
            stage = {**row, "stage": part.stage_index, "compute_s": round(part.compute_s, 6),
                     "sent_bytes": {"forward": [part.forward_raw_bytes, part.forward_wire_bytes],
                                    "backward": [part.backward_raw_bytes, part.backward_wire_bytes],
                                    "sync": row["sent_bytes"]["sync"]}}
            if k:
                stage.pop("peak_bytes", None)
            out.append(stage)
    return sorted(out, key=lambda r: (r["pipeline"], r["stage"]))
