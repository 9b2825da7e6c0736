"""What the timeline costs: tokens/s with the default sampling (`observe.trace_every: 25`, the
coordinator writing runs/<id>/trace.json) ÷ with tracing off (`trace_every: 0`), alternated
(bench/_harness.py alternate) on the tiny preset in two pinned local stages. A traced step
records a span per forward, backward, receive wait, drain, sync and optimizer step and sends
them with its step report; untraced steps share one no-op context. Target ≥ 0.98.
"""

from __future__ import annotations

import json
import sys

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir

TOKENS_PER_STEP = 8 * 4 * 64
TARGET = 0.98


def cluster(steps: int, traced: bool) -> str:
    observe = "" if traced else "observe: {trace_every: 0}\n"  # traced: the default sampling
    return f"""name: trace-{'on' if traced else 'off'}
coordinator: {{host: 127.0.0.1}}
model: {{preset: tiny}}
train: {{steps: {steps}, checkpoint_every: 0, seed: 0}}
{observe}nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 3]}}
  - {{name: b, device: cpu, threads: 1, layers: [3, 6]}}
"""


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (50, 5, 1) if quick else (200, 10, 3)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(2 * reps)
    traces: list[int] = []

    def side(traced: bool) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(steps, traced), ["--run-dir", "{tmp}/run"], 900, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            if traced:  # the traced side really traced: its trace holds the sampled steps
                traces.append(len(json.loads((tmp / "run" / "trace.json").read_text())["otherData"]["sampled_steps"]))
            return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records]}
        return Side("traced" if traced else "untraced", "trace_every: 25 (default)" if traced else "trace_every: 0",
                    once)

    measured = alternate(side(True), side(False), reps, reporter, retry_budget_s=300)
    return {
        "description": "tiny preset, 2 pinned local stages; default timeline sampling vs none",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "cluster": cluster(steps, True)},
        **compare(measured, "traced", "untraced", TOKENS_PER_STEP, warmup, TARGET),
        "sampled_steps_in_trace": traces,
        "measured": measured,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
