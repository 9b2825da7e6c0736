"""How well the cost model predicts: predicted vs measured step time on emulated clusters.

Each cluster is run as a user runs it (`hetlaunch up`: profile, plan, train); the plan's
predicted step time (launcher/planning/cost_model.py) is compared with the median measured step
time after warm-up. Clusters: a speed mix; a memory limit that forces the cut; a slow
inter-region link; the 6-node, two-region cluster of dp_scaling, where the planner runs
several pipelines and prices their gradient sync. Figure: mean absolute relative error.
Target ≤ 10%. Beside it, "calibrated": the same after calibration (launcher/adapt/calibration.py) —
the corrected prediction against the steps after the calibration window — target ≤ 5%.
"""

from __future__ import annotations

import statistics

from _clusters import BASE_SPEED, cluster, node, up
from dp_scaling import dp_cluster
from _harness import NullReporter, Reporter, temporary_dir

TARGET = 0.10
CALIBRATED_TARGET = 0.05  # after calibration (issue 13; Sailor reports 4.5-6% for its simulator)


def clusters(steps: int) -> dict[str, str]:
    slow_link = "links:\n  - between: [east, west]\n    emulate: {bandwidth_mbps: 20, latency_ms: 10}\n"
    single = "max_pipelines: 1"  # the first three price one pipeline (comparable with earlier runs)
    return {
        "speed_mix": cluster("cm-speed", node("a", 1) + node("b", 1) + node("c", 0.5) + node("d", 0.25), steps,
                             train=single),
        # 4 MiB holds ~3 of the 12 layers (parameters x4 + the micro-batches' activations in flight),
        # so the fastest node cannot take the share its speed would earn it.
        "memory_limit": cluster("cm-memory", node("a", 1, memory_gb=0.004) + node("b", 0.5) + node("c", 0.5), steps,
                                train=single),
        "slow_link": cluster("cm-link", node("a", 1, "east") + node("b", 0.5, "east") + node("c", 1, "west")
                             + node("d", 0.5, "west"), steps, links=slow_link, train=single),
        "data_parallel": dp_cluster(steps, single=False),
    }


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (10, 3, 1) if quick else (16, 4, 2)
    cache = temporary_dir("hetlaunch-bench-cache-")
    todo = clusters(steps)
    reporter.total(len(todo) * reps)
    results = {}
    for name, yaml in todo.items():
        runs = []
        for rep in range(reps):
            reporter.advance(f"{name} (run {rep + 1}/{reps})")
            runs.append(up(yaml, steps, warmup, cache))
        measured = statistics.median(r["measured_step_s"] for r in runs)
        predicted = runs[0]["predicted_step_s"]
        # After calibration: the corrected prediction against the steps after its window
        # (launcher/adapt/calibration.py), the median over the runs.
        calibrated = [r["calibration"]["after_window"]["error_calibrated"] for r in runs
                      if (r.get("calibration") or {}).get("after_window")]
        results[name] = {"predicted_step_s": predicted, "measured_step_s": measured,
                         "error": abs(predicted - measured) / measured, "signed_error": (predicted - measured) / measured,
                         "calibrated_error": abs(statistics.median(calibrated)) if calibrated else None,
                         "calibrated_signed_error": statistics.median(calibrated) if calibrated else None,
                         "stages": runs[0]["stages"], "excluded": runs[0]["excluded"],
                         "pipeline_microbatches": runs[0]["pipeline_microbatches"], "runs": runs}
    reporter.advance("done")
    mean_error = statistics.mean(r["error"] for r in results.values())
    calibrated = [r["calibrated_error"] for r in results.values() if r["calibrated_error"] is not None]
    return {
        "calibrated": {"mean_error": statistics.mean(calibrated) if len(calibrated) == len(results) else None,
                       "target": f"<= {CALIBRATED_TARGET}",
                       "met": len(calibrated) == len(results) and statistics.mean(calibrated) <= CALIBRATED_TARGET},
        "description": "predicted (cost model) vs measured median step time of the planned cut on emulated clusters; "
                       "mean absolute relative error",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "base_speed_factor": BASE_SPEED},
        "clusters": results,
        "figure": {"name": "mean |error|", "value": mean_error, "target": f"<= {TARGET}"},
        "met": mean_error <= TARGET,
    }
