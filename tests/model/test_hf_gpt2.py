"""Hugging Face GPT-2 in and out: the `hetlaunch.models.hf_gpt2` entrypoint trains as one
process with its embedding tied to the output projection across the first and last stage,
`hetlaunch export` writes a file `transformers.GPT2LMHeadModel` loads with the same logits (and
a directory `AutoModelForCausalLM.from_pretrained` loads alone),
and `pretrained:` loads a `save_pretrained` directory, each stage only its own tensors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the [hf] extra; .[dev] installs it
from torch import nn

from conftest import final_parameters, run_hetlaunch
from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
from hetlaunch.runtime.model import build_layer, build_model_range, describe_model
from hetlaunch.runtime.model_spec import ModelSpec


EP = "hetlaunch.models.hf_gpt2:build"
KW = {"seq_len": 16, "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256}
SEED, DATA_SEED, STEPS, LR, WD = 5, 2, 6, 3e-3, 0.01

CLUSTER = f"""name: hf-gpt2
model: {{entrypoint: {EP}, kwargs: {json.dumps(KW)}}}
data: {{seed: {DATA_SEED}}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 4, lr: {LR}, weight_decay: {WD}, seed: {SEED}}}
compression: {{intra_region: none, cross_region: none}}
nodes:
  - {{name: first, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: last, device: cpu, threads: 1, layers: [2, 4]}}
"""


def whole_model(seed: int) -> nn.Sequential:
    """One process, the tie as Hugging Face makes it: one Parameter in both places."""
    model = describe_model(ModelSpec(entrypoint=EP, kwargs=KW), seed)
    layers = [build_layer(model, i, seed) for i in range(model.num_layers)]
    layers[-1].lm_head.weight = layers[0].wte.weight
    return nn.Sequential(*layers)


def reference():
    torch.set_num_threads(1)
    net = whole_model(SEED)
    params = list(net.parameters())  # the tied weight once
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR)
    batches = TokenBatches(stdlib_text_bytes(), KW["seq_len"], seed=DATA_SEED)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for x, y in batches.micro_batches(step, 2, 4):
            loss = nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())
            (loss / 4).backward()
            step_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / 4)
    return losses, net


@pytest.mark.timeout(240)
def test_tied_gpt2_across_first_and_last_stage_equals_one_process_and_exports(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=200)
    assert result.returncode == 0, result.stderr
    got = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want, net = reference()
    for g, w in zip(got, want):
        assert abs(g - w) / w <= 1e-5, (got, want)
    params = final_parameters(run_dir)
    # Both copies took the same updates: still one weight, and the one the single process has.
    assert torch.equal(params["layers.0.wte.weight"], params["layers.3.lm_head.weight"])
    torch.testing.assert_close(params["layers.0.wte.weight"], net[0].wte.weight.detach(), rtol=1e-5, atol=1e-6)

    out = tmp_path / "model.safetensors"
    exported = run_hetlaunch("export", str(run_dir), "-o", str(out), timeout=120)
    assert exported.returncode == 0, exported.stderr
    from hetlaunch.models.hf_gpt2 import config_of

    hf = transformers.GPT2LMHeadModel(config_of(None, {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256,
                                                     "n_positions": 16})).eval()
    from safetensors.torch import load_file

    hf.load_state_dict(load_file(str(out)), strict=True)
    x = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    ours = build_model_range(ModelSpec(entrypoint=EP, kwargs=KW), 0, 4, seed=SEED).layers
    for i, layer in enumerate(ours):
        layer.load_state_dict({k.split(".", 2)[2]: v for k, v in params.items() if k.startswith(f"layers.{i}.")})
    with torch.no_grad():
        logits = nn.Sequential(*ours)(x)
        torch.testing.assert_close(hf(x).logits, logits, rtol=1e-5, atol=1e-5)

    # Into a directory: config.json with the run's sizes (n_positions 16, not GPT-2's 1024) and its
    # tie, so from_pretrained alone builds the model the run trained.
    exported = run_hetlaunch("export", str(run_dir), "-o", str(tmp_path / "gpt2-out"), timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in (tmp_path / "gpt2-out").iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2-out").eval()
    assert isinstance(loaded, transformers.GPT2LMHeadModel) and loaded.config.n_positions == KW["seq_len"]
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied as trained
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, logits, rtol=1e-5, atol=1e-5)


def test_pretrained_loads_each_stage_from_the_saved_shards(tmp_path):
    from hetlaunch.models.hf_gpt2 import config_of

    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(config_of(None, {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 300,
                                                     "n_positions": 32})).eval()
    hf.save_pretrained(tmp_path / "gpt2", safe_serialization=True, max_shard_size="40KB")  # several shards
    assert len(list((tmp_path / "gpt2").glob("*.safetensors"))) > 1
    spec = ModelSpec(entrypoint=EP, kwargs={"seq_len": 16, "pretrained": str(tmp_path / "gpt2")})
    first = build_model_range(spec, 0, 2, seed=0).layers
    rest = build_model_range(spec, 2, 5, seed=0).layers
    assert torch.equal(rest[-1].lm_head.weight, hf.transformer.wte.weight)  # the tie, from the embedding
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*first, *rest)(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    bare = tmp_path / "config-only"
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "gpt2" / "config.json").read_text())
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        build_model_range(ModelSpec(entrypoint=EP, kwargs={"seq_len": 16, "pretrained": str(bare)}), 0, 1, seed=0)


def test_export_of_a_directory_without_a_checkpoint_is_one_line(tmp_path):
    result = run_hetlaunch("export", str(tmp_path), "-o", str(tmp_path / "m.safetensors"), timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "no committed checkpoint" in result.stderr
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.timeout(120)
def test_export_of_a_damaged_checkpoint_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER.replace(f"steps: {STEPS}", "steps: 2"))
    run_dir = tmp_path / "run"
    assert run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=100).returncode == 0
    part = next((run_dir / "checkpoints").glob("step-*/*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-10] ^= 0xFF  # one flipped bit of a tensor
    part.write_bytes(bytes(data))
    out = tmp_path / "m.safetensors"
    result = run_hetlaunch("export", str(run_dir), "-o", str(out), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "sha256" in result.stderr or "checksum" in result.stderr or "does not match" in result.stderr, result.stderr
    assert not out.exists() and not list(tmp_path.glob(".m.safetensors.*"))
