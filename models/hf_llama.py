"""Hugging Face Llama as a hetlaunch model: `model: {entrypoint: hetlaunch.models.hf_llama:build}`.

Layers: 0 = `embed_tokens`, 1..n = the `LlamaDecoderLayer`s of `transformers` itself, n+1 = the
final RMSNorm + `lm_head`. Each decoder layer computes its own rotary tables from the sequence
length (no parameters, so nothing but the hidden state crosses a boundary), and with SDPA
attention and no mask the layer is causal by itself. The head is tied to the embedding when
the config says so (`tie_word_embeddings`, as Llama 3.2 1B/3B do).

Random init from sizes (per layer, from hetlaunch's seeded RNG, as LlamaPreTrainedModel would),
or `pretrained: <local dir>` (config.json + *.safetensors), each stage reading only its own
tensors. `hetlaunch export` writes Hugging Face's names and a config.json of the run's sizes and tying
(`tie_word_embeddings` as trained), so `LlamaForCausalLM.from_pretrained` loads them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from hetlaunch.models._hf import init_layer, layered_model, read_config, require_transformers
from hetlaunch.runtime.model import LayeredModel


class Embeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, idx: Tensor) -> Tensor:
        return self.embed_tokens(idx)


class Block(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.layer = LlamaDecoderLayer(config, layer_idx=index)
        self.rotary = LlamaRotaryEmbedding(config)  # buffers only, not saved

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        out = self.layer(x, position_ids=positions, position_embeddings=self.rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(x))


def hf_name(num_layers: int, index: int, local: str) -> str:
    """A layer's parameter name in LlamaForCausalLM's state dict."""
    if index == 0:
        return f"model.{local}"
    if index == num_layers - 1:
        return local if local == "lm_head.weight" else f"model.{local}"
    return f"model.layers.{index - 1}.{local.removeprefix('layer.')}"


def config_of(pretrained: str | None, sizes: dict):
    config = read_config(require_transformers().LlamaConfig, pretrained, sizes)
    config.attention_dropout = 0.0
    config._attn_implementation = "sdpa"  # causal without a mask tensor
    return config


def build(seq_len: int, num_hidden_layers: int = 2, hidden_size: int = 64, intermediate_size: int = 172,
          num_attention_heads: int = 4, num_key_value_heads: int = 2, vocab_size: int = 256,
          tie_word_embeddings: bool = False, pretrained: str | None = None) -> LayeredModel:
    """Llama with `num_hidden_layers` decoder layers (stage layers: + 2), or the one in `pretrained`."""
    last_id = vocab_size - 1
    config = config_of(pretrained, {"num_hidden_layers": num_hidden_layers, "hidden_size": hidden_size,
                                    "intermediate_size": intermediate_size, "num_attention_heads": num_attention_heads,
                                    "num_key_value_heads": num_key_value_heads, "vocab_size": vocab_size,
                                    "max_position_embeddings": seq_len, "tie_word_embeddings": tie_word_embeddings,
                                    "bos_token_id": min(1, last_id), "eos_token_id": min(2, last_id)})
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}")
    num_layers = config.num_hidden_layers + 2

    def make(index: int) -> nn.Module:
        if index == 0:
            return Embeddings(config)
        return Head(config) if index == num_layers - 1 else Block(config, index - 1)

    return layered_model(num_layers, config, "LlamaForCausalLM", make, pretrained, partial(hf_name, num_layers),
                         lambda key: key,
                         "embed_tokens.weight" if config.tie_word_embeddings else None,
                         lambda layer: init_layer(layer, config.initializer_range))
