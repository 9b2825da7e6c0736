"""One finished run (a 1-node tiny model, 4 steps, checkpoints at 2 and 4), made once per test
module (tests/conftest.py `finished`) and copied for each case to spoil (`run`): the hostile
run-directory tests share it, and these helpers."""

from __future__ import annotations

import subprocess

CLUSTER = """
name: hostile-dirs
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 2}}
nodes: [{{name: a, device: cpu, threads: 1}}]
"""


def checkpoint_step(run_dir, step: int):
    return run_dir / "checkpoints" / f"step-{step:08d}"


def one_error_line(result: subprocess.CompletedProcess, code: int) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]
