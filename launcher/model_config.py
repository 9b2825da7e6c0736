"""The cluster YAML's `model:` and `data:` sections (launcher/cluster_config.py holds the rest of
the schema): which model trains, and on which tokens."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hetlaunch.launcher.config_errors import FieldError, show
from hetlaunch.launcher.config_types import MAX_MODEL_DIM, Seed, Strict, YamlFloat, home_path
from hetlaunch.runtime.model_spec import PRESETS, GPTConfig, ModelSpec

_SIZE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "d_ff")


class ModelConfig(Strict):
    preset: str | None = "tiny"  # a name in hetlaunch.runtime.model_spec.PRESETS; the sizes below override it
    vocab_size: int | None = Field(None, ge=1, le=MAX_MODEL_DIM)  # token ids the model takes (256: bytes; a tokenizer's size for token files)
    d_model: int | None = Field(None, ge=1, le=MAX_MODEL_DIM)  # width of the residual stream
    n_layers: int | None = Field(None, ge=1, le=MAX_MODEL_DIM)  # transformer blocks (stage layers = n_layers + 2: embedding, head)
    n_heads: int | None = Field(None, ge=1, le=MAX_MODEL_DIM)  # attention heads; must divide d_model
    seq_len: int | None = Field(None, ge=1, le=MAX_MODEL_DIM)  # tokens per sample
    d_ff: int | None = Field(None, ge=1, le=MAX_MODEL_DIM)  # MLP hidden width (default 4 * d_model)
    entrypoint: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # "package.module:function" instead of the built-in GPT
    kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the entrypoint (needs seq_len); only with entrypoint

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            raise ValueError(f"unknown preset {value!r} (valid: {', '.join(sorted(PRESETS))})")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.entrypoint is not None:
            clashing = [f for f in ("preset", *_SIZE_FIELDS) if f in self.model_fields_set and getattr(self, f) is not None]
            if clashing:
                raise FieldError((clashing[0],), "cannot be combined with model.entrypoint (the entrypoint defines the model)")
            self.preset = None  # the default preset does not apply to an entrypoint model
            seq_len = self.kwargs.get("seq_len")
            if type(seq_len) is not int or seq_len < 1:
                raise FieldError(("kwargs", "seq_len"), f"a positive integer is required with model.entrypoint (got {show(seq_len)})")
            return self
        if self.kwargs:
            raise FieldError(("kwargs",), "only used with model.entrypoint")
        if self.preset is None:
            raise FieldError(("preset",), f"set a preset (valid: {', '.join(sorted(PRESETS))}) or model.entrypoint")
        self._gpt()  # d_model must divide by n_heads once the preset is merged in
        return self

    def _gpt(self) -> GPTConfig:
        base = PRESETS[self.preset]
        sizes = {f: getattr(self, f) for f in _SIZE_FIELDS if getattr(self, f) is not None}
        d_model, n_heads = sizes.get("d_model", base.d_model), sizes.get("n_heads", base.n_heads)
        if d_model % n_heads:  # GPTConfig refuses this; report it in YAML terms instead
            raise FieldError(("d_model",), f"must be divisible by model.n_heads (got d_model {d_model}, n_heads {n_heads})")
        return GPTConfig(**{**{f: getattr(base, f) for f in ("vocab_size", *_SIZE_FIELDS)}, **sizes})

    @property
    def num_stage_layers(self) -> int | None:
        """Stage layers of the built-in GPT (n_layers + 2); None for an entrypoint model."""
        return self.to_spec().known_num_layers

    def to_spec(self) -> ModelSpec:
        if self.entrypoint is not None:
            return ModelSpec(entrypoint=self.entrypoint, kwargs=dict(self.kwargs))
        return ModelSpec(gpt=self._gpt())


class DataConfig(Strict):
    # text: a file's bytes are the tokens (vocabulary 256); tokens: a flat file of token ids
    # (nanoGPT's format, as `hetlaunch prepare-data` writes), memory-mapped.
    format: Literal["text", "tokens"] = "text"
    path: str | None = Field(None, min_length=1)  # the file; default (text only): the Python standard library's own sources
    dtype: Literal["uint16", "uint32"] = "uint16"  # tokens: the ids' width
    seed: Seed = 0  # shuffling / sampling seed
    eval_fraction: YamlFloat = Field(0.1, gt=0, lt=1)  # with train.eval_every: the data's tail held out, never trained on

    @field_validator("path")
    @classmethod
    def _home(cls, value: str | None) -> str | None:
        return None if value is None else str(home_path(value))  # `~/data.bin`: the user's home, not a folder named ~

    @model_validator(mode="after")
    def _tokens_need_a_file(self) -> DataConfig:
        if self.format == "tokens" and self.path is None:
            raise FieldError(("path",), "a token file is required with data.format: tokens")
        return self
