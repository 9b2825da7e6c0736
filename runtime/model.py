"""Models as an ordered list of layers, so any contiguous range can be a pipeline stage.

Two sources of models:

* the built-in byte-level GPT (``GPTConfig`` / ``PRESETS``): layer 0 is the
  embedding, layers ``1..n_layers`` are transformer blocks, the last layer is
  the head (final LayerNorm + projection to the vocabulary);
* a user entrypoint ``"package.module:function"``.

The entrypoint contract. ``function(**kwargs)`` returns ``(layers, loss_fn)``:

* ``layers`` is an ordered list/tuple (or ``nn.ModuleList`` / ``nn.Sequential``)
  of ``nn.Module``. Layer 0 receives the input batch, a LongTensor ``[B, T]``
  of token ids. Every layer returns exactly one tensor, which is the only
  input of the next layer (that single tensor is what crosses a stage link).
* ``loss_fn(last_output, targets)`` takes the last layer's output and the
  targets, a LongTensor ``[B, T]``, and returns a scalar tensor.
* Parameters should be created on CPU; the executor moves them. The function
  is called under a fixed CPU seed so every process that builds the model gets
  the same initial weights; it must not depend on other randomness.
* ``kwargs["seq_len"]`` is the sequence length the data pipeline uses.

Initialisation is per layer: GPT layer ``i`` draws its weights from its own
generator seeded by ``(seed, i)``, so a stage that builds only layers
``[2, 5)`` holds exactly the weights a single process building ``[0, n)`` holds
for those layers. Nothing touches the global RNG state of the caller.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec

LossFn = Callable[[Tensor, Tensor], Tensor]


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


def _layer_seed(seed: int, index: int) -> int:
    # A hash rather than arithmetic so distinct (seed, index) pairs never collide
    # and negative seeds are fine; 63 bits fits every generator.
    digest = hashlib.blake2b(f"hetlaunch-layer:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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


def _make_gpt_layer(cfg: GPTConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.num_stage_layers - 1:
        return Head(cfg)
    return Block(cfg)


def _check_range(start: int, end: int, num_layers: int) -> None:
    if not (0 <= start < end <= num_layers):
        raise ValueError(
            f"layer range [{start}, {end}) is not a non-empty range inside [0, {num_layers})"
        )


def build_gpt_range(cfg: GPTConfig, start: int, end: int, seed: int) -> list[nn.Module]:
    """Build only layers [start, end) of the GPT, each initialised from its own (seed, index) generator."""
    _check_range(start, end, cfg.num_stage_layers)
    layers = []
    for i in range(start, end):
        # The modules' default init draws from the global RNG; fork it so building
        # a stage never changes the caller's random stream (the draws are then
        # overwritten by the per-layer generator anyway).
        with torch.random.fork_rng(devices=[]):
            layer = _make_gpt_layer(cfg, i)
        gen = torch.Generator().manual_seed(_layer_seed(seed, i))
        _init_gpt_layer(layer, cfg, gen)
        layers.append(layer)
    return layers


def _resolve_entrypoint(entrypoint: str) -> Callable:
    module_name, sep, func_name = entrypoint.partition(":")
    if (
        not sep
        or not func_name.isidentifier()
        or not all(part.isidentifier() for part in module_name.split("."))
    ):
        raise ValueError(f"model.entrypoint must look like 'package.module:function', got {entrypoint!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model.entrypoint {entrypoint!r}: cannot import module {module_name!r} ({e})"
        ) from e
    func = getattr(module, func_name, None)
    if func is None:
        raise ValueError(f"model.entrypoint {entrypoint!r}: module {module_name!r} has no attribute {func_name!r}")
    if not callable(func):
        raise ValueError(f"model.entrypoint {entrypoint!r}: {func_name!r} is not callable")
    return func


_CONTRACT = (
    "it must return (layers, loss_fn): layers a non-empty list/tuple/nn.ModuleList/nn.Sequential "
    "of nn.Module, loss_fn a callable (last_output, targets) -> scalar tensor"
)


def load_entrypoint_layers(entrypoint: str, kwargs: dict, seed: int) -> tuple[list[nn.Module], LossFn]:
    """Import ``package.module:function`` and call it under a fixed CPU seed (see module docstring)."""
    func = _resolve_entrypoint(entrypoint)
    # Seed only the CPU generator, inside a fork, so every process gets the same
    # weights and the caller's RNG streams (CPU and CUDA) are left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        result = func(**kwargs)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"model.entrypoint {entrypoint!r} returned {type(result).__name__}; {_CONTRACT}")
    layers, loss_fn = result
    if not isinstance(layers, (list, tuple, nn.ModuleList, nn.Sequential)):
        raise TypeError(f"model.entrypoint {entrypoint!r} returned layers of type {type(layers).__name__}; {_CONTRACT}")
    layers = list(layers)
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise TypeError(f"model.entrypoint {entrypoint!r} returned empty layers or a non-nn.Module layer; {_CONTRACT}")
    if not callable(loss_fn):
        raise TypeError(f"model.entrypoint {entrypoint!r} returned a non-callable loss_fn; {_CONTRACT}")
    return layers, loss_fn


def count_layers(spec: ModelSpec) -> int:
    """The model's layer count. An entrypoint's depth is known only by building it once, so only
    an agent does this (its profile reports the count); the launcher never calls it."""
    if spec.gpt is not None:
        return spec.gpt.num_stage_layers
    layers, _ = load_entrypoint_layers(spec.entrypoint, spec.kwargs, seed=0)
    return len(layers)


@dataclass
class ModelBundle:
    layers: list[nn.Module]  # only the requested contiguous range [start, end)
    loss_fn: LossFn
    num_layers: int  # total layers in the full model


def build_model_range(spec: ModelSpec, start: int, end: int, seed: int) -> ModelBundle:
    if spec.gpt is not None:
        total = spec.gpt.num_stage_layers
        _check_range(start, end, total)
        return ModelBundle(build_gpt_range(spec.gpt, start, end, seed), lm_loss, total)
    # A user function builds the whole model; keep only this stage's slice.
    layers, loss_fn = load_entrypoint_layers(spec.entrypoint, spec.kwargs, seed)
    _check_range(start, end, len(layers))
    return ModelBundle(layers[start:end], loss_fn, len(layers))
