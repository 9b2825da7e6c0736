"""Two pipelines with different cuts train one model exactly as one process would.

Real processes end to end: `hetlaunch up` starts a coordinator and five agents; pipeline 0
runs on three of them (layers 0–1 | 2–4 | 5–7), pipeline 1 on two (0–3 | 4–7). The step's
4 micro-batches are split 3:1, every layer's gradients are summed over its two holders by
c10d groups (one per distinct holder pair), and both replicas step. The single-process
reference from tests/single_process_reference.py trains the whole model on the same 4 micro-batches.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import final_parameters, run_hetlaunch
from single_process_reference import CFG, CLIP, DATA_SEED, LR, MICRO_BATCH, NUM_MICRO, RECIPE, SEED, STEPS, WEIGHT_DECAY

CLUSTER = f"""
name: data-parallel
model: {{preset: tiny, seq_len: {CFG.seq_len}, d_model: {CFG.d_model}, n_layers: {CFG.n_layers}, n_heads: {CFG.n_heads}}}
data: {{seed: {DATA_SEED}}}
train:
  steps: {STEPS}
  micro_batch_size: {MICRO_BATCH}
  num_microbatches: {NUM_MICRO}
  pipeline_microbatches: [3, 1]
  schedule: SCHEDULE
  lr: {LR}
  weight_decay: {WEIGHT_DECAY}
  seed: {SEED}
  {RECIPE.replace(", ", chr(10) + "  ")}
compression: {{intra_region: none, cross_region: none, sync: SYNC}}
nodes:
  - {{name: a0, device: cpu, threads: 1, pipeline: 0, layers: [0, 2]}}
  - {{name: a1, device: cpu, threads: 1, pipeline: 0, layers: [2, 5]}}
  - {{name: a2, device: cpu, threads: 1, pipeline: 0, layers: [5, 8]}}
  - {{name: b0, device: cpu, threads: 1, pipeline: 1, layers: [0, 4]}}
  - {{name: b1, device: cpu, threads: 1, pipeline: 1, layers: [4, 8]}}
"""


def _train(tmp_path, schedule: str, sync: str):
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(CLUSTER.replace("SCHEDULE", schedule).replace("SYNC", sync))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=200)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The checkpoint is written by pipeline 0's stages (one writer per layer).
    return lines, final_parameters(run_dir), json.loads((run_dir / "summary.json").read_text())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zb-h2"])
def test_two_pipelines_match_single_process(schedule, reference, tmp_path):
    lines, params, summary = _train(tmp_path, schedule, "none")
    assert summary["plan"]["pipeline_microbatches"] == [3, 1]
    ref_losses, ref_params = reference
    assert [r["step"] for r in lines] == list(range(STEPS))
    for got, want in zip((r["loss"] for r in lines), ref_losses):
        assert abs(got - want) / abs(want) <= 1e-5, (got, want)
    # Clipping used the whole model's norm, summed over both pipelines' stages, on every step.
    assert all(r["grad_norm"] > CLIP for r in lines), [r["grad_norm"] for r in lines]
    assert params.keys() == ref_params.keys()
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # Every stage synced gradients: four holder sets (layers 0-1, 2-3, 4, 5-7), each stage in at least one.
    synced = {entry["node"] for entry in summary["gradient_sync"]}
    assert synced == {"a0", "a1", "a2", "b0", "b1"}


@pytest.mark.timeout(240)
def test_compressed_sync_stays_near_the_exact_run(reference, tmp_path):
    """int8 sync with error feedback: lossy, but training stays near the exact run."""
    lines, _, summary = _train(tmp_path, "1f1b", "int8")
    ref_losses, _ = reference
    assert abs(lines[-1]["loss"] - ref_losses[-1]) / ref_losses[-1] <= 0.02
    for entry in summary["gradient_sync"]:
        assert entry["wire_bytes"] < 0.3 * entry["raw_bytes"], entry  # int8 + scales: ~0.27 of fp32


REGIONS = CLUSTER.split("nodes:")[0].replace("pipeline_microbatches: [3, 1]", "pipeline_microbatches: [2, 1, 1]") + """\
nodes:
  - {name: e0, region: east, device: cpu, threads: 1, pipeline: 0, layers: [0, 8]}
  - {name: w0, region: west, device: cpu, threads: 1, pipeline: 1, layers: [0, 8]}
  - {name: e1, region: east, device: cpu, threads: 1, pipeline: 2, layers: [0, 3]}
  - {name: e2, region: east, device: cpu, threads: 1, pipeline: 2, layers: [3, 8]}
"""


@pytest.mark.timeout(240)
def test_hierarchical_sync_across_regions_matches_single_process(reference, tmp_path):
    """Three pipelines, two of them in region east: each layer's gradients are summed inside east,
    exchanged with west's holder by the two regions' leaders, and broadcast back inside east
    (compression.sync_topology: hierarchical). The step is still the single-process step."""
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(REGIONS.replace("SCHEDULE", "1f1b").replace(
        "sync: SYNC}", "sync: none, sync_topology: hierarchical}"))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=200)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [g["hierarchical"] for g in summary["plan"]["sync"]] == [True, True]
    ref_losses, ref_params = reference
    assert [r["step"] for r in lines] == list(range(STEPS))
    for got, want in zip((r["loss"] for r in lines), ref_losses):
        assert abs(got - want) / abs(want) <= 1e-5, (got, want)
    params = final_parameters(run_dir)
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6, msg=name)
    assert {entry["node"] for entry in summary["gradient_sync"]} == {"e0", "w0", "e1", "e2"}


@pytest.fixture(scope="module")
def reference():
    from single_process_reference import reference_training

    return reference_training()
