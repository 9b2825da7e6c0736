"""The built-in GPT as an ordered list of layers: layer 0 is the token + position embedding,
layers 1..n_layers are pre-norm transformer blocks, the last is the head (final LayerNorm and
projection to the vocabulary). Each layer is initialised from its own (seed, index) generator
(runtime/model.py), so a stage that builds only layers [2, 5) holds exactly the weights a single
process building [0, n) holds for those layers."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetlaunch.runtime.model_spec import GPTConfig


class Embedding(nn.Module):
    """Token + learned position embedding: LongTensor [B, T] -> float [B, T, D]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[-1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        return self.tok(idx) + self.pos(pos)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # [B, T, D] -> [B, H, T, D/H]
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block. No dropout: pipeline and single-process runs must agree."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.ff_dim)
        self.proj = nn.Linear(cfg.ff_dim, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm + projection to the vocabulary. Not tied to the embedding,
    because the two usually live on different stages."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy over all tokens: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def _init_gpt_layer(layer: nn.Module, cfg: GPTConfig, gen: torch.Generator) -> None:
    """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled
    by 1/sqrt(2 * n_layers) so the residual stream does not grow with depth."""
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        # named_modules() order is fixed by construction, so draws are reproducible.
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.LayerNorm):
                nn.init.ones_(mod.weight)
                nn.init.zeros_(mod.bias)
            elif isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, 0.0, 0.02, generator=gen)
            elif isinstance(mod, nn.Linear):
                std = resid_std if name.endswith("proj") else 0.02
                nn.init.normal_(mod.weight, 0.0, std, generator=gen)
                nn.init.zeros_(mod.bias)


def make_gpt_layer(cfg: GPTConfig, index: int) -> nn.Module:
    """Layer ``index``, allocated once and initialised from the CPU generator as it stands (seeded
    per layer by runtime/model.py build_layer). The modules' own default init is skipped: they are
    built on the meta device and then given storage, so no draw is made twice."""
    if index == 0:
        kind = Embedding
    elif index == cfg.num_stage_layers - 1:
        kind = Head
    else:
        kind = Block
    with torch.device("meta"):
        layer = kind(cfg)
    if torch.get_default_device().type == "meta":
        return layer  # asked for its shapes only (export checks a checkpoint so): no storage, no init
    layer.to_empty(device="cpu")
    _init_gpt_layer(layer, cfg, torch.default_generator)
    return layer


def gpt_layer_kind(cfg: GPTConfig, index: int) -> str:
    if index == 0:
        return "embedding"
    return "head" if index == cfg.num_stage_layers - 1 else "block"
