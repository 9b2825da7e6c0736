"""What several pipelines buy: the planner's best plan vs the best single pipeline.

An emulated 6-node cluster (speeds scaled to an eighth, so six agents share 2 cores) in two regions joined by a slow link (20 Mbps, 20 ms), speeds
mixed within each region. Side A: `hetlaunch up` as a user runs it (the planner may use
several data-parallel pipelines, each with its own cut, gradients synced per layer group).
Side B: the same cluster with `max_pipelines: 1` (the planner's best single pipeline).
Alternated A, B. Figure: measured tokens/s(A) / tokens/s(B), next to the cost model's
prediction of the same ratio (predicted step B / predicted step A).
"""

from __future__ import annotations

import statistics

from _clusters import cluster, node, up
from _harness import NullReporter, Reporter, temporary_dir

MICROBATCHES = 8
# Six agents on 2 cores: at the usual quarter speed they kept ~1.5 cores busy and slowed each
# other (and gloo's sync threads) unevenly; at an eighth they seldom contend.
BASE_SPEED = 0.125
SPEEDS = {"e1": ("east", 1.0), "e2": ("east", 0.5), "e3": ("east", 0.5),
          "w1": ("west", 1.0), "w2": ("west", 1.0), "w3": ("west", 0.5)}
SLOW_LINK = "links:\n  - between: [east, west]\n    emulate: {bandwidth_mbps: 20, latency_ms: 20}\n"


def dp_cluster(steps: int, single: bool) -> str:
    nodes = "".join(node(name, speed, region, base_speed=BASE_SPEED) for name, (region, speed) in SPEEDS.items())
    return cluster("dp-single" if single else "dp-planned", nodes, steps, MICROBATCHES, links=SLOW_LINK,
                   train="max_pipelines: 1" if single else "")


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (10, 3, 1) if quick else (16, 4, 2)
    cache = temporary_dir("hetlaunch-bench-cache-")
    sides = {"planned": dp_cluster(steps, single=False), "single": dp_cluster(steps, single=True)}
    reporter.total(2 * reps)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(reps):
        for side, yaml in sides.items():
            reporter.advance(f"{side} (run {rep + 1}/{reps})")
            runs[side].append(up(yaml, steps, warmup, cache))
    reporter.advance("done")
    measured = {side: statistics.median(r["measured_step_s"] for r in rs) for side, rs in runs.items()}
    predicted = {side: rs[0]["predicted_step_s"] for side, rs in runs.items()}
    ratio = measured["single"] / measured["planned"]
    predicted_ratio = predicted["single"] / predicted["planned"]
    return {
        "description": "emulated 6 nodes in 2 regions (20 Mbps / 20 ms between), mixed speeds, 12 layers: tokens/s of "
                       "the planner's best plan (several pipelines allowed) / the best single pipeline, measured and "
                       "as the cost model predicts",
        "config": {"nodes": SPEEDS, "base_speed_factor": BASE_SPEED, "num_microbatches": MICROBATCHES,
                   "steps": steps, "warmup": warmup, "reps": reps},
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        # The issue sets no target for this ratio: it asks for the measured figure next to the prediction.
        "figure": {"name": "tokens/s several pipelines / single pipeline (measured)", "value": ratio,
                   "target": f"none set; the cost model predicts {predicted_ratio:.3f}", "predicted": predicted_ratio},
        "prediction_error": abs(predicted_ratio - ratio) / ratio,
        "planned": {"stages": runs["planned"][0]["stages"], "pipeline_microbatches":
                    runs["planned"][0]["pipeline_microbatches"], "sync": runs["planned"][0]["sync"]},
        "single": {"stages": runs["single"][0]["stages"]},
        "raw": runs,
    }
