"""hetlaunch's 1F1B vs torch.distributed.pipelining's Schedule1F1B on the same 2-stage split.

Side A: `hetlaunch up` with two local agents (threads 1 each, gloo), the model's stage
layers cut evenly and pinned. Side B: two bench/torch_pipelining_worker.py processes
(1 thread each, gloo, rendezvous on a TCPStore this process hosts on 127.0.0.1) running
PipelineStage + Schedule1F1B on the same layer ranges with the same weights, batches
and micro-batches. A step's time is the slowest stage's (max over stages of each
stage's own step time, as hetlaunch's metrics record it). Alternated A, B, A, B.
Ratio = hetlaunch tokens/s / torch.distributed.pipelining tokens/s.
"""

from __future__ import annotations

from _harness import NullReporter, Reporter, Side, alternate, compare, hetlaunch_up, max_loss_gap, run_worker_ranks
from hetlaunch.launcher.planning.plan import even_split

TARGET = 1.0
NUM_STAGES = 2
MODEL = {"seq_len": 128, "d_model": 128, "n_layers": 4, "n_heads": 4}  # 6 stage layers: [0, 3) | [3, 6)
TRAIN = {"micro_batch_size": 8, "num_microbatches": 4, "lr": 3e-3, "weight_decay": 0.0, "seed": 0, "data_seed": 0}
RANGES = even_split(MODEL["n_layers"] + 2, NUM_STAGES)


def settings(quick: bool) -> dict:
    return ({"steps": 12, "warmup": 3, "reps": 2, "retry_budget_s": 0} if quick
            else {"steps": 20, "warmup": 4, "reps": 8, "retry_budget_s": 90})


def cluster_yaml(steps: int) -> str:
    m, t = MODEL, TRAIN
    nodes = "\n".join(f"  - {{name: stage{i}, device: cpu, threads: 1, layers: [{s}, {e}]}}"
                      for i, (s, e) in enumerate(RANGES))
    return f"""name: bench-vs-torch-pipelining
model: {{preset: small, seq_len: {m['seq_len']}, d_model: {m['d_model']}, n_layers: {m['n_layers']}, n_heads: {m['n_heads']}}}
data: {{seed: {t['data_seed']}}}
train:
  steps: {steps}
  micro_batch_size: {t['micro_batch_size']}
  num_microbatches: {t['num_microbatches']}
  schedule: 1f1b
  lr: {t['lr']}
  weight_decay: {t['weight_decay']}
  seed: {t['seed']}
compression: {{intra_region: none, cross_region: none}}  # raw float32 on the wire, as on the other side
nodes:
{nodes}
"""


def run_hetlaunch(steps: int) -> dict:
    records = hetlaunch_up(cluster_yaml(steps), timeout_s=120 + 5 * steps)
    return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records],
            "stage_step_s": [[s["step_s"] for s in r["stages"]] for r in records]}


def run_torch(steps: int) -> dict:
    config = {"model": MODEL, "ranges": RANGES, "steps": steps, **TRAIN}
    per_rank = run_worker_ranks("torch_pipelining_worker.py", config, NUM_STAGES, 120 + 5 * steps,
                                "torch.distributed.pipelining")
    stage_step_s = [list(times) for times in zip(*(r["step_s"] for r in per_rank))]
    return {"step_s": [max(times) for times in stage_step_s], "loss": per_rank[-1]["loss"],
            "stage_step_s": stage_step_s}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    s = settings(quick)
    reporter.total(2 * s["reps"])
    measured = alternate(Side("hetlaunch", "hetlaunch 1F1B, 2 stages", lambda: run_hetlaunch(s["steps"])),
                         Side("torch_pipelining", "torch.distributed.pipelining 1F1B, 2 stages",
                              lambda: run_torch(s["steps"])),
                         s["reps"], reporter, s["retry_budget_s"])
    tokens_per_step = TRAIN["micro_batch_size"] * TRAIN["num_microbatches"] * MODEL["seq_len"]
    return {
        "description": "hetlaunch 1F1B / torch.distributed.pipelining Schedule1F1B, 2 stages x 1 thread, gloo, "
                       "same layer ranges, weights, batches and micro-batches; step time = slowest stage's; "
                       "tokens/s = tokens per step / median steady step time, median over alternated runs",
        "sides": {"a": "hetlaunch", "b": "torch_pipelining"},
        "config": {"model": MODEL, "train": TRAIN, "ranges": RANGES, "backend": "gloo",
                   "tokens_per_step": tokens_per_step, **s},
        **compare(measured, "hetlaunch", "torch_pipelining", tokens_per_step, s["warmup"], TARGET),
        "max_loss_gap": max_loss_gap(measured["runs"], "hetlaunch", "torch_pipelining"),
        "raw": measured,
    }
