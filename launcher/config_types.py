"""The cluster YAML's shared building blocks: strict models, names, numbers and pairs as users write them."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from hetlaunch.launcher.config_errors import show


class ConfigError(Exception):
    """One-line, user-facing message; the CLI prints it and exits 2."""


def home_path(value: str) -> Path:
    """The path with `~` and `~user` expanded, as a shell does; ValueError (a one-line message)
    where the user has no home here: Path.expanduser raises RuntimeError, which reached users of
    `validate`, `plan` and `prepare-data` as a traceback (a hostile review)."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise ValueError(f"{value!r}: {value.split('/', 1)[0]!r} is no user's home on this host") from None


def _sci_float(value: Any) -> Any:
    # PyYAML (YAML 1.1) reads `3e-3` (no dot) as a *string*; take it as the number the user meant.
    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+\s*", value):
        return float(value)
    return value


YamlFloat = Annotated[float, BeforeValidator(_sci_float), Field(allow_inf_nan=False)]
MAX_NAME = 64  # characters in the cluster name and in node and region names


def starts_alnum(value: str) -> str:
    # Names become file names and command-line values: `-rf` or `--parent-pid` must never look like an option.
    if not (value[:1].isascii() and value[:1].isalnum()):
        raise ValueError(f"must start with a letter or digit (got {show(value)})")
    return value


# Node and region names: 1-64 of letters, digits, '_', '.', '-', starting with a letter or digit.
# NAME_RE says the same for names that come from outside a YAML (an agent's flags, discovery, `logs`).
NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME - 1}}}")
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=MAX_NAME), AfterValidator(starts_alnum)]


# Upper bounds on the YAML's integers. Each lands in a protocol field (uint32 counts, int64 seeds)
# and sizes something: without them a number past the field's range passed `validate` and ended
# `up` in a traceback ("Value out of range"), and a model dimension in the billions in an
# allocation. Generous for any real job.
MAX_STEPS = 10**9  # steps, and every "every N steps" and "at step N"
MAX_COUNT = 1 << 20  # samples in a micro-batch, nodes, pipelines, restarts, checkpoints kept
MAX_MODEL_DIM = 1 << 24  # vocabulary, widths, layers, heads, sequence length
MAX_THREADS = 4096  # torch threads of one agent (micro-batches in a step: runtime/registry.py MAX_MICROBATCHES)
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]  # the protocol's int64


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def listed_pair(value: Any) -> Any:
    if isinstance(value, list):  # YAML has lists, the schema wants a pair
        if len(value) != 2:
            raise ValueError(f"must be a pair [a, b] (got {len(value)} items)")
        return tuple(value)
    return value


Pair = BeforeValidator(listed_pair)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
