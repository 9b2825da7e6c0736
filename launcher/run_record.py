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
    """Joins the per-stage reports of one step into one record once every stage has reported.

    With several pipelines the step's loss is the mean over all its micro-batches: each
    pipeline's mean weighted by its share, and its tokens are the pipelines' sum.
    """

    def __init__(self, plan):
        self.position = {}  # node -> (pipeline, stage index)
        for p, stages in enumerate(plan.pipelines()):
            for j, stage in enumerate(stages):
                self.position[stage.node] = (p, j)
        self.shares = plan.pipeline_microbatches
        self.pending: dict[int, dict[tuple[int, int], tuple[str, pb.StepMetrics]]] = {}

    def add(self, node: str, metrics: pb.StepMetrics) -> StepRecord | None:
        reports = self.pending.setdefault(metrics.step, {})
        reports[self.position[node]] = (node, metrics)
        if len(reports) < len(self.position):
            return None
        del self.pending[metrics.step]
        ordered = [(position, *reports[position]) for position in sorted(reports)]
        loss = sum(m.loss * self.shares[p] for (p, _), _, m in ordered if m.has_loss) / sum(self.shares)
        # Stages overlap in a pipeline and pipelines run side by side: the step takes as long as the slowest.
        step_s = max(m.step_s for _, _, m in ordered)
        tokens = sum(m.tokens for (_, j), _, m in ordered if j == 0)
        stages = [{"pipeline": p, "stage": j, "node": node, "step_s": round(m.step_s, 6),
                   "compute_s": round(m.compute_s, 6), "comm_s": round(m.comm_s, 6), "sync_s": round(m.sync_s, 6),
                   "sent_bytes": {"forward": [m.forward_raw_bytes, m.forward_wire_bytes],
                                  "backward": [m.backward_raw_bytes, m.backward_wire_bytes],
                                  "sync": [m.sync_raw_bytes, m.sync_wire_bytes]}}
                  for (p, j), node, m in ordered]
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
                "links": self._links(), "gradient_sync": self._sync()}

    def _links(self) -> list[dict]:
        """Per stage boundary of each pipeline: bytes before and after compression over the whole
        run, both directions."""
        stages = self.records[0].stages
        links = []
        for j, (a, b) in enumerate(zip(stages, stages[1:])):
            if a["pipeline"] != b["pipeline"]:
                continue
            raw = wire = 0
            for r in self.records:
                fwd = r.stages[j]["sent_bytes"]["forward"]
                bwd = r.stages[j + 1]["sent_bytes"]["backward"]
                raw += fwd[0] + bwd[0]
                wire += fwd[1] + bwd[1]
            links.append({"pipeline": a["pipeline"], "boundary": a["stage"], "from": a["node"], "to": b["node"],
                          "raw_bytes": raw, "wire_bytes": wire, "compression_ratio": raw / wire if wire else 1.0})
        return links

    def _sync(self) -> list[dict]:
        """Per stage that synced gradients with other pipelines: bytes over the run, blocked time per step."""
        out = []
        for i, stage in enumerate(self.records[0].stages):
            raw = sum(r.stages[i]["sent_bytes"]["sync"][0] for r in self.records)
            wire = sum(r.stages[i]["sent_bytes"]["sync"][1] for r in self.records)
            if raw:
                out.append({"node": stage["node"], "raw_bytes": raw, "wire_bytes": wire,
                            "mean_blocked_s": sum(r.stages[i]["sync_s"] for r in self.records) / len(self.records)})
        return out
