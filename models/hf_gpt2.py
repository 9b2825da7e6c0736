"""Hugging Face GPT-2 as a hetlaunch model: `model: {entrypoint: hetlaunch.models.hf_gpt2:build}`.

Layers: 0 = token + position embeddings (`transformer.wte`, `.wpe`), 1..n = the `GPT2Block`s of
`transformers` itself, n+1 = final LayerNorm + `lm_head`. The output projection is tied to the
token embedding as in GPT-2 (`tied`): a stage holding either keeps its copy, and the two
holders sum their gradients every step, so training equals one process with the tie.

Random init from a config (GPT-2's scheme, per layer from hetlaunch's seeded RNG), or
`pretrained: <local dir>` (a `save_pretrained` directory: config.json + *.safetensors), where
each stage reads only its own layers' tensors. `hetlaunch export` writes the trained weights
back under Hugging Face's names, with a config.json of the run's sizes (n_positions = the
seq_len trained, unless `pretrained` said more), so `from_pretrained` loads them. Needs `transformers`
(`pip install 'hetlaunch[hf]'`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from hetlaunch.models._hf import gpt2_residual_scale, init_layer, layered_model, read_config, require_transformers
from hetlaunch.runtime.model import LayeredModel


class Embeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[-1], device=idx.device)
        return self.wte(idx) + self.wpe(positions)


class Block(nn.Module):
    """One `transformers` GPT2Block. With no attention mask and SDPA attention the block is
    causal by itself, so only the hidden state crosses a stage boundary."""

    def __init__(self, config, index: int) -> None:
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        self.block = GPT2Block(config, layer_idx=index)

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def hf_name(num_layers: int, index: int, local: str) -> str:
    """A layer's parameter name in GPT2LMHeadModel's state dict."""
    if index == 0:
        return f"transformer.{local}"
    if index == num_layers - 1:
        return "lm_head.weight" if local == "lm_head.weight" else f"transformer.{local}"
    return f"transformer.h.{index - 1}.{local.removeprefix('block.')}"


def config_of(pretrained: str | None, sizes: dict):
    config = read_config(require_transformers().GPT2Config, pretrained, sizes)
    # No dropout (pipeline and one process must agree); SDPA: causal without a mask tensor.
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    config._attn_implementation = "sdpa"
    return config


def build(seq_len: int, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = 256,
          pretrained: str | None = None) -> LayeredModel:
    """GPT-2 with `n_layer` blocks (stage layers: n_layer + 2), or the one saved in `pretrained`."""
    config = config_of(pretrained, {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "vocab_size": vocab_size,
                                  "n_positions": seq_len,
                                  # GPT-2's <|endoftext|> id, or the last id of a smaller vocabulary
                                  "bos_token_id": min(50256, vocab_size - 1), "eos_token_id": min(50256, vocab_size - 1)})
    if seq_len > config.n_positions:
        raise ValueError(f"seq_len {seq_len} exceeds the model's n_positions {config.n_positions}")
    num_layers = config.n_layer + 2

    def make(index: int) -> nn.Module:
        if index == 0:
            return Embeddings(config)
        return Head(config) if index == num_layers - 1 else Block(config, index - 1)

    # Old GPT-2 files name the body without the "transformer." prefix.
    return layered_model(num_layers, config, "GPT2LMHeadModel", make, pretrained, partial(hf_name, num_layers),
                         lambda key: key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}",
                         "wte.weight",
                         # GPT-2's scheme, as GPT2PreTrainedModel._init_weights
                         lambda layer: init_layer(layer, config.initializer_range, gpt2_residual_scale(config.n_layer)))
