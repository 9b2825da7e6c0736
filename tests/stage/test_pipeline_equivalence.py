"""Pipeline training across 3 agent processes equals single-process training, step by step.

Real processes end to end: `hetlaunch up` starts a gRPC coordinator and three agents, which
train an uneven split (1 | 6 | 1 layers) over gloo with 4 micro-batches. A single-process
reference trains the whole model on the same batches with the same seed.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import final_parameters, run_hetlaunch
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import ModelSpec
from single_process_reference import (CFG, CLIP, DATA_SEED, LR, MICRO_BATCH, NUM_MICRO, RECIPE, SEED, STEPS,
                                      WEIGHT_DECAY, reference_lr, reference_training)

CLUSTER = f"""
name: equivalence
model: {{preset: tiny, seq_len: {CFG.seq_len}, d_model: {CFG.d_model}, n_layers: {CFG.n_layers}, n_heads: {CFG.n_heads}}}
data: {{seed: {DATA_SEED}}}
train:
  steps: {STEPS}
  micro_batch_size: {MICRO_BATCH}
  num_microbatches: {NUM_MICRO}
  schedule: SCHEDULE
  lr: {LR}
  weight_decay: {WEIGHT_DECAY}
  seed: {SEED}
  {RECIPE.replace(", ", chr(10) + "  ")}
compression: {{intra_region: none, cross_region: none}}  # exact numerics: no lossy codec may be chosen
nodes:
  - {{name: head, device: cpu, threads: 1, layers: [0, 1]WINDOW0}}
  - {{name: body, device: cpu, threads: 1, layers: [1, 7]WINDOW1}}
  - {{name: tail, device: cpu, threads: 1, layers: [7, 8]WINDOW2}}
"""


@pytest.fixture(scope="module")
def reference():
    return reference_training()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule, windows", [("1f1b", None), ("gpipe", None), ("1f1b", (4, 3, 2)), ("zb-h1", None),
                                               ("zb-h2", None)],
                         ids=["1f1b", "gpipe", "1f1b-deeper-windows", "zb-h1", "zb-h2"])
def test_pipeline_matches_single_process(schedule, windows, reference, tmp_path):
    """Deeper windows (1F1B's own here are 3, 2, 1) reorder forwards and backwards; the math must not move."""
    text = CLUSTER.replace("SCHEDULE", schedule)
    for j in range(3):
        text = text.replace(f"WINDOW{j}", f", window: {windows[j]}" if windows else "")
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(text)
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=150)
    assert result.returncode == 0, result.stderr + result.stdout

    ref_losses, ref_params = reference
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    for got, want in zip((r["loss"] for r in lines), ref_losses):
        assert abs(got - want) / abs(want) <= 1e-5, (got, want)
    assert [r["lr"] for r in lines] == pytest.approx([reference_lr(s) for s in range(STEPS)], rel=1e-12)
    assert all(r["grad_norm"] > CLIP for r in lines), [r["grad_norm"] for r in lines]

    merged = final_parameters(run_dir)
    assert merged.keys() == ref_params.keys()
    for name, want in ref_params.items():
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # Guard against a reference that never stepped (then "equal" would prove nothing).
    initial = build_model_range(ModelSpec(gpt=CFG), 0, 1, seed=SEED).layers[0]
    assert not torch.allclose(initial.tok.weight, merged["layers.0.tok.weight"])


def _run(tmp_path, name: str, schedule: str, codec: str) -> tuple[list[float], dict]:
    text = CLUSTER.replace("SCHEDULE", schedule).replace("WINDOW0", "").replace("WINDOW1", "").replace("WINDOW2", "")
    text = text.replace("compression: {intra_region: none, cross_region: none}",
                        f"compression: {{intra_region: {codec}, cross_region: {codec}}}")
    (tmp_path / f"{name}.yaml").write_text(text)
    result = run_hetlaunch("up", str(tmp_path / f"{name}.yaml"), "--run-dir", str(tmp_path / name), timeout=150)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines], final_parameters(tmp_path / name)


@pytest.mark.timeout(450)
def test_zero_bubble_with_a_lossy_codec_equals_1f1b_with_it_bit_for_bit(tmp_path):
    """int8 on both links: ZB-H1 and ZB-H2 split each backward and move the weight gradients (ZB-H2
    its forwards too), but every micro-batch's tensors, codes and the order the weights sum them in
    (micro-batch order, W's run oldest first) are 1F1B's. One 1F1B run, compared with both."""
    one_losses, one_params = _run(tmp_path, "one", "1f1b", "int8")
    assert len(one_losses) == STEPS
    for schedule in ("zb-h1", "zb-h2"):
        zb_losses, zb_params = _run(tmp_path, schedule, schedule, "int8")
        assert zb_losses == one_losses, schedule
        assert one_params.keys() == zb_params.keys()
        assert all(torch.equal(one_params[k], zb_params[k]) for k in one_params), schedule
