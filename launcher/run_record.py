"""The run directory: metrics.jsonl (one line per step) and summary.json (written whole, once)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hetlaunch.protos import control_pb2 as pb


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    step_s: float
    stages: list[dict]

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "loss": self.loss, "tokens_per_s": self.tokens_per_s,
                           "step_s": self.step_s, "stages": self.stages})


class StepAggregator:
    """Joins the per-stage reports of one step into one record once every stage has reported."""

    def __init__(self, stage_of_node: dict[str, int]):
        self.stage_of_node = stage_of_node
        self.pending: dict[int, dict[int, tuple[str, pb.StepMetrics]]] = {}

    def add(self, node: str, metrics: pb.StepMetrics) -> StepRecord | None:
        reports = self.pending.setdefault(metrics.step, {})
        reports[self.stage_of_node[node]] = (node, metrics)
        if len(reports) < len(self.stage_of_node):
            return None
        del self.pending[metrics.step]
        ordered = [reports[i] for i in sorted(reports)]
        loss = next(m.loss for _, m in ordered if m.has_loss)
        # Stages overlap in a pipeline, so the step takes as long as its slowest stage's step.
        step_s = max(m.step_s for _, m in ordered)
        tokens = ordered[0][1].tokens
        stages = [{"stage": m.stage_index, "node": node, "step_s": round(m.step_s, 6),
                   "compute_s": round(m.compute_s, 6), "comm_s": round(m.comm_s, 6),
                   "sent_bytes": {"forward": [m.forward_raw_bytes, m.forward_wire_bytes],
                                  "backward": [m.backward_raw_bytes, m.backward_wire_bytes]}}
                  for node, m in ordered]
        return StepRecord(step=metrics.step, loss=loss, tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
                          step_s=step_s, stages=stages)


@dataclass
class RunRecord:
    run_dir: Path
    records: list[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / "metrics.jsonl", "w")

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        self._metrics.write(record.to_json() + "\n")
        self._metrics.flush()

    def close(self) -> None:
        self._metrics.close()

    def write_summary(self, summary: dict) -> None:
        """Write summary.json atomically, so a reader never sees half a file."""
        tmp = self.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.run_dir / "summary.json")

    def summarize(self) -> dict:
        """Loss at both ends and mean throughput; the first step is left out of the mean (warm-up)."""
        if not self.records:
            return {"steps": 0}
        timed = self.records[1:] or self.records
        tokens = sum(r.tokens_per_s * r.step_s for r in timed)
        seconds = sum(r.step_s for r in timed)
        return {"steps": len(self.records), "first_loss": self.records[0].loss,
                "final_loss": self.records[-1].loss, "mean_tokens_per_s": tokens / seconds if seconds else 0.0,
                "links": self._links()}

    def _links(self) -> list[dict]:
        """Per stage boundary: bytes before and after compression over the whole run, both directions."""
        num_stages = len(self.records[0].stages)
        links = []
        for j in range(num_stages - 1):
            raw = wire = 0
            for r in self.records:
                fwd = r.stages[j]["sent_bytes"]["forward"]
                bwd = r.stages[j + 1]["sent_bytes"]["backward"]
                raw += fwd[0] + bwd[0]
                wire += fwd[1] + bwd[1]
            links.append({"boundary": j, "from": self.records[0].stages[j]["node"],
                          "to": self.records[0].stages[j + 1]["node"], "raw_bytes": raw, "wire_bytes": wire,
                          "compression_ratio": raw / wire if wire else 1.0})
        return links
