"""A node slows to 0.3x mid-run: tokens/s in the 50 steps after, with and without rebalancing.

The speed mix of cost_model_error (speeds 1, 1, 0.5, 0.25, 12 layers, one pipeline),
120 steps, checkpoints every 10; node b slows to 0.3x its speed at step 40
(`emulate.speed_changes`, which the profile never sees). Three runs, defaults on:

* (a) no rebalancing (`train.rebalance: false`): the plan made for the old speeds runs on;
* (b) rebalancing (the default): calibration, the straggler found, and either a live move of
  layers in the running stages or a new plan switched to at a checkpoint, whichever the watch
  predicts to gain more net of its cost (launcher/adapt/straggler.py);
* (c) a plan made for the new speeds from the start (b profiled at 0.3x).

Figure: (b) ÷ (c) (target ≥ 0.9), beside (b) ÷ (a) (target ≥ 1.3) and the steps from the
slowdown to the first step of the new plan. Tokens/s over steps 40-89 is their tokens over the
wall time between the reports of step 39 and step 89, so a restart's time counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from _clusters import BASE_SPEED, MODEL, run_cli
from _harness import BenchError, NullReporter, Reporter, temporary_dir

STEPS, SLOW_AT, WINDOW, SLOW = 120, 40, 50, 0.3


def _yaml(case: str) -> str:
    speeds = {"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.25}
    nodes = ""
    for name, speed in speeds.items():
        emulate = f"speed: {speed * BASE_SPEED:g}"
        if name == "b" and case == "fresh":
            emulate = f"speed: {speed * SLOW * BASE_SPEED:g}"
        elif name == "b":
            emulate += f", speed_changes: [{{at_step: {SLOW_AT}, speed: {speed * SLOW * BASE_SPEED:g}}}]"
        nodes += f"  - {{name: {name}, region: r0, device: cpu, threads: 1, emulate: {{{emulate}}}}}\n"
    rebalance = ", rebalance: false" if case == "none" else ""
    return (f"name: straggler-{case}\nmodel: {MODEL}\n"
            f"train: {{steps: {STEPS}, micro_batch_size: 8, num_microbatches: 8, schedule: 1f1b, max_pipelines: 1, "
            f"checkpoint_every: 10{rebalance}}}\nnodes:\n{nodes}")


def _window(run_dir: Path) -> dict:
    metrics = {json.loads(line)["step"]: json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    first, last = metrics.get(SLOW_AT - 1), metrics.get(SLOW_AT + WINDOW - 1)
    if first is None or last is None:
        raise BenchError(f"{run_dir}: steps {SLOW_AT - 1} and {SLOW_AT + WINDOW - 1} not both recorded")
    tokens = sum(metrics[s]["tokens_per_s"] * metrics[s]["step_s"] for s in range(SLOW_AT, SLOW_AT + WINDOW))
    switched = [e["step"] for e in events if (e["event"] == "first_step" and e.get("step", 0) > 0)
                or e["event"] == "move"]
    return {"tokens_per_s": tokens / (last["time"] - first["time"]),
            "stragglers": [e for e in events if e["event"] == "straggler"],
            "moves": [e for e in events if e["event"] == "move"],
            "rebalanced_at_step": switched[0] if switched else None,
            "plans": [[(s["node"], s["layer_start"], s["layer_end"]) for s in e["plan"]["stages"]]
                      for e in events if e["event"] == "generation"]}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    cache = temporary_dir("hetlaunch-bench-cache-")
    cases = {"none": "(a) no rebalancing", "rebalance": "(b) rebalancing (live or at a checkpoint)", "fresh": "(c) planned for the new speeds"}
    reporter.total(len(cases))
    runs = {}
    for case, label in cases.items():
        reporter.advance(label)
        tmp = run_cli("up", _yaml(case), ["--run-dir", "{tmp}/run"], 900, cache)
        runs[case] = _window(tmp / "run")
    reporter.advance("done")
    b_over_c = runs["rebalance"]["tokens_per_s"] / runs["fresh"]["tokens_per_s"]
    b_over_a = runs["rebalance"]["tokens_per_s"] / runs["none"]["tokens_per_s"]
    switched = runs["rebalance"]["rebalanced_at_step"]
    return {
        "description": f"tokens/s over steps {SLOW_AT}-{SLOW_AT + WINDOW - 1} after node b slows to {SLOW}x at step "
                       f"{SLOW_AT} (4 local agents, speeds 1, 1, 0.5, 0.25 scaled by {BASE_SPEED}, {STEPS} steps, "
                       "checkpoints every 10, defaults on)",
        "runs": runs,
        "tokens_per_s": {case: r["tokens_per_s"] for case, r in runs.items()},
        "b_over_a": b_over_a,
        "steps_to_rebalance": None if switched is None else switched - SLOW_AT,
        "figure": {"name": "rebalanced ÷ planned for the new speeds", "value": b_over_c, "target": ">= 0.9"},
        "met": b_over_c >= 0.9 and b_over_a >= 1.3,
    }
