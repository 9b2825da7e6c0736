"""The profile cache: per-node layer timings keyed by what they depend on, so `up` measures a node once.

One JSON file per key under $HETLAUNCH_CACHE_DIR (default ~/.cache/hetlaunch/profiles).

A cache file is not trusted: anyone (a crash, a full disk, another version, a person) may
have left anything there. Every entry is checked against `CacheEntry` on read — finite,
positive times, non-negative byte counts of a sane size, every codec timed, all per-layer
lists as long as the model's layers — and a bad one is reported in one line naming the
file and treated as not cached, so the node is measured again and the fresh entry replaces
the file. Entries are written whole (temporary file, fsync, rename) or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetlaunch.launcher.planning.profile_file import LayerInfo, MaybeZeroSeconds, Seconds
from hetlaunch.launcher.plain_text import escape_controls
from hetlaunch.runtime.files import UnreadableFile, read_json, write_whole
from hetlaunch.runtime.registry import CODEC_NAMES

MAX_ENTRY_BYTES = 16 << 20  # an entry is ~100 bytes a layer; a bigger file is not one of ours


class BadCacheEntry(ValueError):
    """One-line reason a cache entry cannot be used."""


class CacheEntry(BaseModel):
    """A node's layer timings: the profile's own field types (launcher/planning/profile_file.py),
    stricter still (no "1" or true for 1), since only hetlaunch writes these files."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    layer_seconds: list[Seconds] = Field(min_length=1)
    optimizer_seconds: list[MaybeZeroSeconds]
    codec_seconds_per_byte: dict[str, MaybeZeroSeconds]
    layers: list[LayerInfo]
    # Absent in entries written before it was measured; bounded as the profile's NodeProfile is (1e300 passed
    # here and failed there, in a traceback, on every later `up`).
    cpu_per_wall: float | None = Field(None, ge=0, le=1_000_000)
    cipher_seconds_per_byte: MaybeZeroSeconds | None = None  # likewise
    input_grad_seconds: list[MaybeZeroSeconds] | None = None  # likewise: the backward split (zero bubble)
    weight_grad_seconds: list[MaybeZeroSeconds] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "CacheEntry":
        n = len(self.layer_seconds)
        for name in ("optimizer_seconds", "layers", "input_grad_seconds", "weight_grad_seconds"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, layer_seconds {n}")
        if set(self.codec_seconds_per_byte) != set(CODEC_NAMES):
            raise ValueError(f"codec_seconds_per_byte names {sorted(self.codec_seconds_per_byte)}, "
                             f"not the codecs {sorted(CODEC_NAMES)}")
        return self


def cache_dir() -> Path:
    return Path(os.environ.get("HETLAUNCH_CACHE_DIR", Path.home() / ".cache" / "hetlaunch")) / "profiles"


def cache_path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def node_cache_key(**identity: object) -> str:
    """Device type, emulation, model and micro-batch shape: what a layer timing depends on."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def check_entry(data: object, num_layers: int | None = None) -> dict:
    """The entry as a plain dict if it is a usable one (for a model of `num_layers` layers,
    where the caller knows it); else BadCacheEntry with a one-line reason."""
    try:
        entry = CacheEntry.model_validate(data, strict=True)  # strict in the nested LayerInfo too
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise BadCacheEntry(f"{where}: {first['msg']}{more}") from None
    if num_layers is not None and len(entry.layer_seconds) != num_layers:
        raise BadCacheEntry(f"layer_seconds has {len(entry.layer_seconds)} entries for a model of {num_layers} layers")
    return entry.model_dump(exclude_none=True)  # cpu_per_wall: absent from entries written before it


def cached_node(key: str, num_layers: int | None = None, console=None) -> dict | None:
    """The cached entry for `key`, or None: none cached, or a bad one (reported on `console`
    in one line naming the file; the fresh measurement will replace it)."""
    path = cache_path(key)
    try:
        return read_entry(path, num_layers)
    except FileNotFoundError:
        return None
    except BadCacheEntry as err:
        _warn(console, f"ignoring cached profile {path}: {err}; measuring the node again")
        return None


def read_entry(path: Path, num_layers: int | None = None) -> dict:
    """The checked entry in a cache file; BadCacheEntry names what is wrong."""
    try:
        data = read_json(path, MAX_ENTRY_BYTES)
    except UnreadableFile as err:
        raise BadCacheEntry(str(err)) from None
    return check_entry(data, num_layers)


def store_node(key: str, entry: dict, console=None) -> None:
    """Write the entry whole or not at all. A cache that cannot be written costs a re-measure
    next time, not this job: the problem is reported and the job goes on."""
    path = cache_path(key)
    try:
        check_entry(entry)
    except BadCacheEntry as err:
        _warn(console, f"not caching the measurement in {path}: {err}")
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(entry, allow_nan=False))
    except OSError as err:
        _warn(console, f"cannot write profile cache {path}: {err.strerror or err}")


def _warn(console, message: str) -> None:
    if console is None:
        import sys

        print(f"warning: {escape_controls(message)}", file=sys.stderr, flush=True)
    else:  # a cache file's key or value may hold a terminal's escape sequences
        console.print(f"warning: {escape_controls(message)}", markup=False, highlight=False, soft_wrap=True)
