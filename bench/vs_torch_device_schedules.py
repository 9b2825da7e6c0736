"""Two stages per device against the peer: hetlaunch's executor running interleaved 1F1B and ZB-V
(runtime/device_schedules.py) vs torch.distributed.pipelining's ScheduleInterleaved1F1B and
ScheduleZBVZeroBubble, on the same model, 4-stage cut, weights, batches and micro-batches, two
ranks of one thread each over gloo (bench/device_schedule_worker.py).

What it measures is the engine: the hetlaunch side is its executor driven directly, without
`up`'s control plane, as a stage worker would drive it (host memory kept from step to step as a
worker keeps it, runtime/host_allocator.py). A step's time is the slower rank's; the sides
alternate A, B, A, B per schedule, and their per-step losses must agree (max_loss_gap). Target: hetlaunch ÷ torch ≥ 1.0 tokens/s for each schedule.
"""

from __future__ import annotations

import json
import sys

from _harness import NullReporter, Reporter, Side, alternate, compare, max_loss_gap, run_worker_ranks
from hetlaunch.launcher.planning.plan import even_split

TARGET = 1.0
DEVICES = 2
SCHEDULES = ("zb-v", "interleaved-1f1b")
MODEL = {"seq_len": 128, "d_model": 128, "n_layers": 6, "n_heads": 4}  # 8 stage layers: 2 per stage
TRAIN = {"micro_batch_size": 4, "num_microbatches": 8, "lr": 3e-3, "weight_decay": 0.0, "seed": 0, "data_seed": 0}
RANGES = even_split(MODEL["n_layers"] + 2, 2 * DEVICES)


def settings(quick: bool) -> dict:
    return ({"steps": 8, "warmup": 2, "reps": 1, "retry_budget_s": 0} if quick
            else {"steps": 16, "warmup": 3, "reps": 4, "retry_budget_s": 90})


def run_side(side: str, schedule: str, steps: int) -> dict:
    config = {"side": side, "schedule": schedule, "model": MODEL, "ranges": RANGES, "devices": DEVICES,
              "steps": steps, **TRAIN}
    per_rank = run_worker_ranks("device_schedule_worker.py", config, DEVICES, 120 + 5 * steps, f"{side} {schedule}")
    stage_step_s = [list(times) for times in zip(*(r["step_s"] for r in per_rank))]
    losses = next(r["loss"] for r in per_rank if r["loss"])
    return {"step_s": [max(times) for times in stage_step_s], "loss": losses, "rank_step_s": stage_step_s}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    s = settings(quick)
    reporter.total(2 * s["reps"] * len(SCHEDULES))
    tokens_per_step = TRAIN["micro_batch_size"] * TRAIN["num_microbatches"] * MODEL["seq_len"]
    per_schedule = {}
    for schedule in SCHEDULES:
        measured = alternate(Side("hetlaunch", f"hetlaunch {schedule}",
                                  lambda schedule=schedule: run_side("hetlaunch", schedule, s["steps"])),
                             Side("torch_pipelining", f"torch.distributed.pipelining {schedule}",
                                  lambda schedule=schedule: run_side("torch", schedule, s["steps"])),
                             s["reps"], reporter, s["retry_budget_s"])
        per_schedule[schedule] = {
            **compare(measured, "hetlaunch", "torch_pipelining", tokens_per_step, s["warmup"], TARGET),
            "max_loss_gap": max_loss_gap(measured["runs"], "hetlaunch", "torch_pipelining"),
            "raw": measured}
    first = per_schedule[SCHEDULES[0]]
    return {
        "description": "hetlaunch's executor with two stages per rank / torch.distributed.pipelining, "
                       "ScheduleZBVZeroBubble and ScheduleInterleaved1F1B, 2 ranks x 1 thread, gloo, same 4-stage "
                       "cut, weights, batches, micro-batches; step = slower rank's; alternated per schedule; the "
                       "hetlaunch side keeps host memory from step to step as a stage worker does",
        "sides": {"a": "hetlaunch", "b": "torch_pipelining"},
        "config": {"model": MODEL, "train": TRAIN, "ranges": RANGES, "devices": DEVICES,
                   "tokens_per_step": tokens_per_step, **s},
        # The headline is ZB-V's; each schedule's figures are under `schedules`.
        **{k: v for k, v in first.items() if k != "raw"},
        "schedules": per_schedule,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
