"""Hugging Face Llama: `hetlaunch.models.hf_llama` stages chain to the logits of
`transformers.LlamaForCausalLM` with the same weights (per-layer rotary tables, causal without a
mask), `pretrained:` reads each stage's tensors from the shards, and a 3-stage run exports a file
LlamaForCausalLM loads and a directory `from_pretrained` loads alone."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the [hf] extra; .[dev] installs it
from safetensors.torch import load_file
from torch import nn

from conftest import run_hetlaunch
from hetlaunch.models.hf_llama import config_of
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import ModelSpec

EP = "hetlaunch.models.hf_llama:build"
SIZES = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300}


def _hf(tied: bool):
    config = config_of(None, {**SIZES, "max_position_embeddings": 32, "tie_word_embeddings": tied,
                              "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_pretrained_stages_chain_to_llamas_logits(tmp_path, tied):
    hf = _hf(tied)
    hf.save_pretrained(tmp_path / "llama", safe_serialization=True, max_shard_size="60KB")
    spec = ModelSpec(entrypoint=EP, kwargs={"seq_len": 16, "pretrained": str(tmp_path / "llama")})
    first, rest = build_model_range(spec, 0, 2, seed=0).layers, build_model_range(spec, 2, 5, seed=0).layers
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*first, *rest)(x), hf(x).logits, rtol=1e-5, atol=1e-5)
    if tied:
        assert torch.equal(rest[-1].lm_head.weight, hf.model.embed_tokens.weight)


@pytest.mark.timeout(240)
def test_a_llama_run_exports_what_llama_for_causal_lm_loads(tmp_path):
    kwargs = {"seq_len": 16, **SIZES, "tie_word_embeddings": True}
    (tmp_path / "c.yaml").write_text(f"""name: llama
model: {{entrypoint: {EP}, kwargs: {json.dumps(kwargs)}}}
train: {{steps: 3, micro_batch_size: 2, num_microbatches: 2}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 3]}}
  - {{name: c, device: cpu, threads: 1, layers: [3, 5]}}
""")
    assert run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"), timeout=200).returncode == 0
    out = tmp_path / "llama.safetensors"
    assert run_hetlaunch("export", str(tmp_path / "run"), "-o", str(out), timeout=120).returncode == 0
    hf = _hf(True)
    hf.load_state_dict(load_file(str(out)), strict=True)
    state = load_file(str(out))
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # still tied after training
    layers = build_model_range(ModelSpec(entrypoint=EP, kwargs=kwargs), 0, 5, seed=0).layers
    for i, layer in enumerate(layers):
        prefix = {0: "model.", 4: ""}.get(i, f"model.layers.{i - 1}.")
        own = {local: state[(prefix + local.removeprefix("layer.")) if i not in (0, 4) else
                            ("lm_head.weight" if local == "lm_head.weight" else "model." + local)]
               for local, _ in layer.named_parameters()}
        layer.load_state_dict(own, strict=False)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = nn.Sequential(*layers)(x)
        torch.testing.assert_close(logits, hf(x).logits, rtol=1e-5, atol=1e-5)
    # Into a directory, from_pretrained alone: the run's sizes and its tie (LlamaConfig's default is untied).
    assert run_hetlaunch("export", str(tmp_path / "run"), "-o", str(tmp_path / "out"), timeout=120).returncode == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(loaded, transformers.LlamaForCausalLM) and loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, logits, rtol=1e-5, atol=1e-5)
