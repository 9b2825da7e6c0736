"""What bf16 costs or buys on this machine: tokens/s of bf16 ÷ fp32, and the loss gap.

The local example's shape without emulation: the tiny preset cut into three pinned stages on
three local agents, the defaults users get (`compression: auto`), 200 steps, alternated
fp32, bf16, fp32, bf16 (bench/_harness.py alternate). Throughput is the median of each run's
steady steps; the loss gap is the mean of the last 10 steps' losses, bf16 against fp32, as a
fraction. A CPU without bf16 arithmetic (AVX512-BF16/AMX) runs bf16 autocast slower than fp32:
the figure says what a CPU user gets; the GPU figure comes from bench/gpu_check.sh.
"""

from __future__ import annotations

import json
import statistics
import sys

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir

TOKENS_PER_STEP = 8 * 4 * 64  # the tiny preset's defaults: micro_batch_size 8, 4 micro-batches, seq_len 64
LOSS_TARGET = 0.03


def cluster(precision: str, steps: int) -> str:
    return f"""name: precision-{precision}
model: {{preset: tiny}}
train: {{steps: {steps}, precision: {precision}, checkpoint_every: 0, seed: 0}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4]}}
  - {{name: c, device: cpu, threads: 1, layers: [4, 6]}}
"""


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (40, 5, 1) if quick else (200, 10, 2)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(2 * reps + 1)

    def side(precision: str) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(precision, steps), ["--run-dir", "{tmp}/run"], 900, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records]}
        return Side(precision, precision, once)

    measured = alternate(side("bf16"), side("fp32"), reps, reporter, retry_budget_s=300)
    result = compare(measured, "bf16", "fp32", TOKENS_PER_STEP, warmup, target=1.0)
    final = {p: statistics.mean(statistics.mean(r["loss"][-10:]) for r in measured["runs"][p]) for p in ("bf16", "fp32")}
    gap = (final["bf16"] - final["fp32"]) / final["fp32"]
    return {
        "description": "tiny preset, 3 pinned local stages, compression auto, bf16 vs fp32 alternated",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "cluster": cluster("bf16", steps)},
        **result,
        "figure": {"name": "bf16 / fp32 tokens/s (CPU)", "value": result["ratio"], "target": "report"},
        "final_loss": final,
        "loss_gap": gap,
        "met": abs(gap) <= LOSS_TARGET,
        "measured": measured,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
