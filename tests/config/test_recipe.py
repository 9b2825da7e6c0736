"""The training recipe: learning-rate schedules, weight decay only on weights, SGD with momentum
(checkpointed and restored like AdamW), and a held-out evaluation loss that is the loss of the
trained weights on data never trained on. Pipeline == single process with clipping and a
schedule is in test_pipeline_equivalence.py and test_data_parallel.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from conftest import final_parameters, run_hetlaunch
from hetlaunch.runtime.checkpoint import apply_state, stage_state
from hetlaunch.runtime.checkpoint_manifest import CheckpointError
from hetlaunch.runtime.data import open_data
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.optim import Recipe, make_optimizer, parameter_groups

torch.set_num_threads(1)


def test_warmup_then_each_schedule_reaches_its_floor_at_the_last_step():
    for schedule in ("constant", "linear", "cosine"):
        r = Recipe(lr=1.0, lr_schedule=schedule, warmup_steps=4, min_lr_ratio=0.1, total_steps=14)
        assert [r.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
        assert r.lr_at(4) == 1.0
    linear = Recipe(lr=1.0, lr_schedule="linear", warmup_steps=4, min_lr_ratio=0.1, total_steps=14)
    assert linear.lr_at(9) == pytest.approx(0.55) and linear.lr_at(14) == pytest.approx(0.1)
    cosine = Recipe(lr=1.0, lr_schedule="cosine", warmup_steps=4, min_lr_ratio=0.1, total_steps=14)
    assert cosine.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert cosine.lr_at(14) == pytest.approx(0.1) and cosine.lr_at(99) == pytest.approx(0.1)
    assert Recipe(lr=2.0).lr_at(1000) == 2.0
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        Recipe(optimizer="adam")


def test_weight_decay_only_on_weights_of_two_or_more_dimensions():
    model = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    decay, rest = parameter_groups(model, 0.1)
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert {id(p) for p in rest["params"]} == {id(model[1].weight), id(model[1].bias), id(model[2].bias)}
    sgd = make_optimizer(model, Recipe(optimizer="sgd", momentum=0.8, weight_decay=0.1))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8
    assert make_optimizer(nn.ReLU(), Recipe()) is None


def _stepped(optimizer_name: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    optimizer = make_optimizer(model, Recipe(optimizer=optimizer_name, lr=0.1))
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_sgd_momentum_is_checkpointed_and_restored_exactly():
    model, optimizer = _stepped("sgd")
    state = stage_state(model, optimizer, layer_start=3)
    assert any(k.endswith(".momentum_buffer") for k in state) and all(
        k.startswith(("layers.3.", "layers.4.", "optim.3.", "optim.4.")) for k in state)
    fresh = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    fresh_opt = make_optimizer(fresh, Recipe(optimizer="sgd", lr=0.1))
    apply_state(fresh, fresh_opt, state, layer_start=3)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"])


def test_a_checkpoint_of_one_optimizer_is_refused_by_another():
    model, optimizer = _stepped("adamw")
    state = stage_state(model, optimizer, layer_start=0)
    other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match="this run's optimizer is SGD"):
        apply_state(other, make_optimizer(other, Recipe(optimizer="sgd")), state, layer_start=0)


CFG = GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)


@pytest.mark.timeout(180)
def test_sgd_run_with_evaluation_reports_the_held_out_loss_of_its_weights(tmp_path):
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""name: recipe
model: {{preset: tiny, seq_len: {CFG.seq_len}, d_model: {CFG.d_model}, n_layers: {CFG.n_layers}, n_heads: {CFG.n_heads}}}
data: {{seed: 5, eval_fraction: 0.2}}
train: {{steps: 7, micro_batch_size: 2, num_microbatches: 2, optimizer: sgd, lr: 0.05, momentum: 0.9,
         lr_schedule: linear, eval_every: 3, eval_microbatches: 3, seed: 1}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4]}}
""")
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=150)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval_loss" in r] == [2, 5, 6]  # after steps 3, 6 and the last
    assert lines[-1]["lr"] == pytest.approx(0.05 * (0.1 + 0.9 * (1 - 6 / 7)))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] == lines[-1]["eval_loss"]

    # The last evaluation is the loss of the final weights on the held-out tail's windows.
    params = final_parameters(run_dir)
    layers = build_model_range(ModelSpec(gpt=CFG), 0, 4, seed=1).layers
    model = nn.Sequential(*layers)
    model.load_state_dict({k.removeprefix("layers."): v for k, v in params.items()})
    train_batches, held_out = open_data("", "text", "", CFG.seq_len, 5, CFG.vocab_size, eval_fraction=0.2)
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                  for x, y in held_out.micro_batches(0, 2, 3)]
    assert lines[-1]["eval_loss"] == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert len(held_out) < len(train_batches) / 3  # the tail, not the training data
