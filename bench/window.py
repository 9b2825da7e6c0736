"""Deeper 1F1B windows over a distant link: tokens/s of the planner's plan (defaults on:
compression auto, windows as the planner deepens them) ÷ the same plan held to 1F1B's own
windows (`window:` pinned to them in the YAML), alternated, over an emulated 100 ms link;
and each side's predicted step against its measured one (the cost model's error).

Two local stages in two regions, 8 micro-batches: 1F1B keeps 2 in flight across the link, so
each pair of micro-batches waits a 200 ms round trip; a window of 8 streams them all.
Target: ≥ 1.3.
"""

from __future__ import annotations

import json
import statistics
import sys

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir

MICROBATCHES = 8
TOKENS_PER_STEP = 4 * MICROBATCHES * 32  # micro_batch_size 4, seq_len 32
TARGET = 1.3


def cluster(steps: int, plain: bool) -> str:
    pin = ", window: 2" if plain else ""  # 1F1B's own window for the first of two stages
    return f"""name: window-{'plain' if plain else 'deeper'}
model: {{preset: tiny, n_layers: 2, seq_len: 32, d_model: 32, n_heads: 4}}
train: {{steps: {steps}, micro_batch_size: 4, num_microbatches: {MICROBATCHES}, schedule: 1f1b, checkpoint_every: 0,
        seed: 0}}
links:
  - between: [near, far]
    emulate: {{latency_ms: 100}}
nodes:
  - {{name: a, region: near, device: cpu, threads: 1, layers: [0, 2]{pin}}}
  - {{name: b, region: far, device: cpu, threads: 1, layers: [2, 4]}}
"""


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (12, 3, 1) if quick else (40, 5, 3)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(2 * reps)

    def side(plain: bool) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(steps, plain), ["--run-dir", "{tmp}/run"], 600, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            plan = json.loads((tmp / "run" / "summary.json").read_text())["plan"]
            return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records],
                    "windows": [s.get("window", 0) for s in plan["stages"]],
                    "predicted_step_s": plan.get("predicted_step_s")}
        return Side("plain" if plain else "deeper", "1F1B's own windows" if plain else "planner's windows", once)

    measured = alternate(side(False), side(True), reps, reporter, retry_budget_s=300)
    result = compare(measured, "deeper", "plain", TOKENS_PER_STEP, warmup, TARGET)
    errors = {}
    for key, runs in measured["runs"].items():
        ratios = [statistics.median(r["step_s"][warmup:]) / r["predicted_step_s"] - 1
                  for r in runs if r.get("predicted_step_s")]
        errors[key] = statistics.median(ratios) if ratios else None
    return {
        "description": "2 local stages across an emulated 100 ms link, 8 micro-batches: the planner's deeper "
                       "1F1B windows vs 1F1B's own (pinned), defaults on",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "deeper": cluster(steps, False),
                   "plain": cluster(steps, True)},
        **result,
        "cost_model_error": errors,  # (measured - predicted) / predicted step, median over runs
        "measured": measured,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
