"""What hetlaunch costs on one node: one stage on one local agent vs a plain PyTorch loop.

Side A runs `hetlaunch up` on a one-node cluster (threads 1, no emulation) and reads
step_s from metrics.jsonl. Side B runs bench/plain_loop_worker.py: the same model,
batches, micro-batching and optimizer in a bare loop. Both are subprocesses with one
thread, alternated A, B, A, B. Ratio = hetlaunch tokens/s / plain tokens/s.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from _harness import BENCH_DIR, NullReporter, Reporter, Side, alternate, compare, hetlaunch_up, max_loss_gap, run_process

TARGET = 0.97
MODEL = {"seq_len": 128, "d_model": 128, "n_layers": 4, "n_heads": 4}  # 6 stage layers, ~0.9M parameters
TRAIN = {"micro_batch_size": 8, "num_microbatches": 4, "lr": 3e-3, "weight_decay": 0.0, "seed": 0, "data_seed": 0}


def settings(quick: bool) -> dict:
    return ({"steps": 12, "warmup": 3, "reps": 2, "retry_budget_s": 0} if quick
            else {"steps": 20, "warmup": 4, "reps": 8, "retry_budget_s": 90})


def cluster_yaml(steps: int) -> str:
    m, t = MODEL, TRAIN
    return f"""name: bench-overhead
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
  - {{name: solo, device: cpu, threads: 1}}
"""


def run_hetlaunch(steps: int) -> dict:
    records = hetlaunch_up(cluster_yaml(steps), timeout_s=120 + 5 * steps)
    return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records]}


def run_plain(steps: int) -> dict:
    config = {"model": MODEL, "steps": steps, **TRAIN}
    with tempfile.TemporaryDirectory(prefix="hetlaunch-bench-") as tmp:
        out = Path(tmp) / "plain.json"
        run_process([sys.executable, str(BENCH_DIR / "plain_loop_worker.py"), json.dumps(config), str(out)],
                    "plain PyTorch loop", timeout_s=60 + 5 * steps)
        return json.loads(out.read_text())


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    s = settings(quick)
    reporter.total(2 * s["reps"])
    measured = alternate(Side("hetlaunch", "hetlaunch, 1 stage", lambda: run_hetlaunch(s["steps"])),
                         Side("plain", "plain PyTorch loop", lambda: run_plain(s["steps"])),
                         s["reps"], reporter, s["retry_budget_s"])
    tokens_per_step = TRAIN["micro_batch_size"] * TRAIN["num_microbatches"] * MODEL["seq_len"]
    return {
        "description": "hetlaunch, 1 stage on 1 local agent (threads 1) / plain PyTorch loop (1 thread), "
                       "same model, batches, micro-batching and AdamW; tokens/s = tokens per step / median "
                       "steady step time, median over alternated runs",
        "sides": {"a": "hetlaunch", "b": "plain"},
        "config": {"model": MODEL, "train": TRAIN, "tokens_per_step": tokens_per_step, **s},
        **compare(measured, "hetlaunch", "plain", tokens_per_step, s["warmup"], TARGET),
        "max_loss_gap": max_loss_gap(measured["runs"], "hetlaunch", "plain"),
        "raw": measured,
    }
