"""train.precision: bf16 and fp16 autocast over fp32 master weights, activations on the links in
the compute dtype, and an fp16 loss scale that skips a step on every stage at once."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import run_hetlaunch
from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.node_measurement import profile_layers
from hetlaunch.runtime.precision import LossScaler
from hetlaunch.runtime.schedules import schedule_for

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _run(tmp_path, precision: str, steps: int) -> tuple[list[dict], dict]:
    yaml_path = tmp_path / f"{precision}.yaml"
    yaml_path.write_text(f"""name: precision
model: {{preset: tiny}}
train: {{steps: {steps}, micro_batch_size: 4, num_microbatches: 2, precision: {precision}, checkpoint_every: 0, seed: 3,
        lr: 1.0e-3}}
compression: {{intra_region: none, cross_region: none}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 3]}}
  - {{name: b, device: cpu, threads: 1, layers: [3, 6]}}
""")
    run_dir = tmp_path / precision
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=240)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return lines, json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(420)
def test_bf16_and_fp16_end_within_2_percent_of_fp32_and_halve_the_link_bytes(tmp_path):
    """At the default lr (3e-3) this tiny model's 150 steps are chaotic: one seed's final loss
    moved 3-7% between fp32, bf16 and fp16 on a CPU with AMX bf16 kernels (and within 3% on
    another CPU), so the precision was not what the test measured. At 1e-3 seeds 3, 4 and 5 ended
    within 0.5% of fp32 in both dtypes on that CPU; the bench (bench/precision.py) measures the
    default's over 5 seeds."""
    steps = 150
    fp32, fp32_summary = _run(tmp_path, "fp32", steps)
    for precision in ("bf16", "fp16"):
        lines, summary = _run(tmp_path, precision, steps)
        final = sum(r["loss"] for r in lines[-10:]) / 10
        want = sum(r["loss"] for r in fp32[-10:]) / 10
        assert abs(final - want) / want <= 0.02, (precision, final, want)
        assert fp32[0]["loss"] - want > 1.0  # both runs really trained
        # The same activations cross the same links in half the bytes (no codec: "none").
        assert len(summary["links"]) == len(fp32_summary["links"]) == 1
        for ours, theirs in zip(summary["links"], fp32_summary["links"]):
            assert ours["raw_bytes"] * 2 == theirs["raw_bytes"], (ours, theirs)


def _stage(precision: str, overflow_elsewhere: bool) -> StageExecutor:
    torch.manual_seed(0)
    return StageExecutor([nn.Linear(8, 8), nn.Linear(8, 8)], lambda out, y: out.float().pow(2).mean(), is_first=True,
                         is_last=True, device=CPU, precision=precision,
                         any_over_model=lambda mine: mine or overflow_elsewhere)


def test_an_overflow_on_any_stage_skips_the_step_and_halves_the_scale():
    data = [(torch.randn(4, 8), torch.zeros(4, 8)) for _ in range(2)]
    actions = schedule_for("gpipe", 0, 1, 2)
    stage = _stage("fp16", overflow_elsewhere=True)
    before = [p.detach().clone() for p in stage.module.parameters()]
    stage.train_step(actions, data, 2)
    assert stage.scaler.scale == 2.0**15 and stage.steps_done == 1
    assert all(torch.equal(a, b) for a, b in zip(before, stage.module.parameters()))  # skipped
    clean = _stage("fp16", overflow_elsewhere=False)
    clean.train_step(actions, data, 2)
    assert clean.scaler.scale == 2.0**16
    assert not all(torch.equal(a, b) for a, b in zip(before, clean.module.parameters()))  # stepped
    # The master weights and the optimizer state stay fp32.
    assert all(p.dtype == torch.float32 for p in clean.module.parameters())
    assert all(v.dtype == torch.float32 for s in clean.optimizer.state.values() for k, v in s.items() if k != "step")


def test_the_scale_grows_after_clean_steps_and_never_below_one():
    scaler = LossScaler(init_scale=4.0, growth_interval=2)
    scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 8.0
    for _ in range(10):
        scaler.update(True)
    assert scaler.scale == 1.0


def test_profiling_in_bf16_sizes_the_boundaries_in_bf16():
    spec = ModelSpec(gpt=GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4))
    fp32 = profile_layers(spec, 2, CPU, warmup=0, repeats=1)
    bf16 = profile_layers(spec, 2, CPU, warmup=0, repeats=1, precision="bf16")
    assert [m.output_bytes * 2 for m in bf16[:-1]] == [m.output_bytes for m in fp32[:-1]]
    assert [m.param_bytes for m in bf16] == [m.param_bytes for m in fp32]  # fp32 master weights
