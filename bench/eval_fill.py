"""Evaluation in the bubbles: what evaluating every step costs, in the step's idle time (the
default, `train.eval_in_bubbles`) and after the step (`eval_in_bubbles: false`), each against the
same job without evaluation.

One pinned 4-stage pipeline, a region per stage, 20 ms links, 8 training micro-batches and 4
held-out ones evaluated after every step (`eval_every: 1`: the worst case), each stage emulating a
tenth of this CPU's speed (as bench/zero_bubble.py, so the four stages' bubbles are idle time, not
another stage's compute). A step here is the time from one step's first action on the first stage
to the next's, read from the trace (`observe.trace_every: 1`, on all sides alike): that interval
holds what evaluation after the step costs, which a step's own `step_s` does not. Runs alternate
with-evaluation and without, for each way; the held-out losses of the two ways must be equal.
Target: with evaluation in the bubbles ÷ without ≥ 1 / 1.02 in tokens/s (the issue's step time
with ÷ without ≤ 1.02).
"""

from __future__ import annotations

import json
import sys

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir

MICROBATCHES = 8
TOKENS_PER_STEP = 4 * MICROBATCHES * 64  # micro_batch_size 4, seq_len 64
TARGET = 1 / 1.02
LATENCY_MS = 20


def cluster(steps: int, evaluation: str) -> str:
    regions = ["r0", "r1", "r2", "r3"]
    links = "\n".join(f"  - {{between: [{a}, {b}], emulate: {{latency_ms: {LATENCY_MS}}}}}"
                      for a, b in zip(regions, regions[1:]))
    nodes = "\n".join(f"  - {{name: n{i}, region: {r}, device: cpu, threads: 1, layers: [{2 * i}, {2 * i + 2}], "
                      f"emulate: {{speed: 0.1}}}}" for i, r in enumerate(regions))
    evaluate = {"none": "eval_every: 0", "bubbles": "eval_every: 1, eval_microbatches: 4",
                "after": "eval_every: 1, eval_microbatches: 4, eval_in_bubbles: false"}[evaluation]
    return f"""name: eval-fill-{evaluation}
model: {{preset: tiny, n_layers: 6, seq_len: 64, d_model: 128, n_heads: 4}}
train: {{steps: {steps}, micro_batch_size: 4, num_microbatches: {MICROBATCHES}, checkpoint_every: 0, seed: 0,
        {evaluate}}}
observe: {{trace_every: 1}}
links:
{links}
nodes:
{nodes}
"""


def periods(trace: dict) -> list[float]:
    """Seconds from each traced step's first action on the first stage to the next step's."""
    starts: dict[int, float] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0:
            step = e["args"]["step"]
            starts[step] = min(starts.get(step, e["ts"]), e["ts"])
    steps = sorted(starts)
    return [(starts[b] - starts[a]) / 1e6 for a, b in zip(steps, steps[1:]) if b == a + 1]


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, reps = (6, 1) if quick else (12, 2)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(4 * reps)

    def side(evaluation: str) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(steps, evaluation), ["--run-dir", "{tmp}/run"], 900, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            trace = json.loads((tmp / "run" / "trace.json").read_text())
            fill = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["name"][:1] == "E"]
            events = [json.loads(line) for line in (tmp / "run" / "events.jsonl").read_text().splitlines() if line]
            predicted = next((e for e in events if e["event"] == "eval_fill"), None)
            return {"step_s": periods(trace), "loss": [r["loss"] for r in records],
                    "eval_loss": [r.get("eval_loss") for r in records],
                    "eval_forward_s": round(sum(e["dur"] for e in fill) / 1e6, 4),
                    "predicted": {k: v for k, v in (predicted or {}).items() if k not in ("time", "event")}}
        return Side(evaluation, {"none": "no evaluation", "bubbles": "evaluation in the bubbles",
                                 "after": "evaluation after the step"}[evaluation], once)

    in_bubbles = alternate(side("bubbles"), side("none"), reps, reporter, retry_budget_s=300)
    after = alternate(side("after"), side("none"), reps, reporter, retry_budget_s=300)
    # The trace keeps the last steps only (launcher/timeline.py MAX_STEPS): all of them are past warm-up.
    result = compare(in_bubbles, "bubbles", "none", TOKENS_PER_STEP, 0, TARGET)
    context = compare(after, "after", "none", TOKENS_PER_STEP, 0, TARGET)
    evals = {key: runs[0]["eval_loss"] for key, runs in (("bubbles", in_bubbles["runs"]["bubbles"]),
                                                          ("after", after["runs"]["after"]))}
    return {
        "description": f"4 pinned local stages, one per region, {LATENCY_MS} ms links, {MICROBATCHES} micro-batches, "
                       "4 held-out ones evaluated after every step, each stage emulating a tenth-speed device: "
                       "evaluation in the bubbles (default) vs none, and after the step vs none, defaults on",
        "config": {"steps": steps, "reps": reps, "bubbles": cluster(steps, "bubbles"), "after": cluster(steps, "after")},
        **result,
        "step_with_over_without": {"bubbles": 1 / result["ratio"] if result["ratio"] else None,
                                   "after": 1 / context["ratio"] if context["ratio"] else None},
        "after_the_step": context,
        "eval_losses_equal": evals["bubbles"] == evals["after"],
        "eval_losses": evals,
        # The coordinator's own prediction (events.jsonl `eval_fill`) for the plan the run used.
        "predicted": in_bubbles["runs"]["bubbles"][0]["predicted"],
        "measured": {"bubbles": in_bubbles, "after": after},
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
