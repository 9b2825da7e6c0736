"""What model to train, described without torch: the built-in GPT's sizes and presets, or a
user entrypoint with its kwargs. The launcher validates and plans with these; only an agent
builds layers from them (runtime/model.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4
    d_ff: int | None = None  # default 4 * d_model

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff must be >= 1 or None, got {self.d_ff}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def num_stage_layers(self) -> int:
        # embedding + blocks + head
        return self.n_layers + 2


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=64, d_model=64, n_layers=4, n_heads=4),
    "small": GPTConfig(seq_len=128, d_model=128, n_layers=6, n_heads=4),
    "medium": GPTConfig(seq_len=128, d_model=256, n_layers=8, n_heads=8),
}


def preset(name: str) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


@dataclass(frozen=True)
class ModelSpec:
    """What to build: exactly one of a GPT config or a user entrypoint."""

    gpt: GPTConfig | None = None
    entrypoint: str | None = None
    kwargs: dict = field(default_factory=dict)  # only for entrypoint

    def __post_init__(self) -> None:
        if (self.gpt is None) == (self.entrypoint is None):
            raise ValueError("ModelSpec needs exactly one of gpt or entrypoint")
        if self.gpt is not None and self.kwargs:
            raise ValueError("ModelSpec.kwargs is only used with an entrypoint, not with gpt")

    @property
    def known_num_layers(self) -> int | None:
        """The layer count where the description alone gives it (the built-in GPT); None for an
        entrypoint, whose depth the agents report in their profiles (runtime/model.py count_layers)."""
        return self.gpt.num_stage_layers if self.gpt is not None else None

    def describe(self) -> str:
        """The model's identity in a profile: a saved profile is only used for the same model."""
        if self.gpt is not None:
            g = self.gpt
            return (f"gpt(vocab={g.vocab_size},seq={g.seq_len},d={g.d_model},layers={g.n_layers},"
                    f"heads={g.n_heads},ff={g.ff_dim})")
        return f"{self.entrypoint}({json.dumps(self.kwargs, sort_keys=True)})"

    @property
    def seq_len(self) -> int:
        if self.gpt is not None:
            return self.gpt.seq_len
        seq_len = self.kwargs.get("seq_len")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(
                f"model.kwargs.seq_len (a positive int) is required with model.entrypoint "
                f"{self.entrypoint!r}, got {seq_len!r}"
            )
        return seq_len
