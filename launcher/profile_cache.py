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
import stat
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hetlaunch.runtime.files import write_whole
from hetlaunch.runtime.registry import CODEC_NAMES

MAX_ENTRY_BYTES = 16 << 20  # an entry is ~100 bytes a layer; a bigger file is not one of ours
MAX_SECONDS = 86_400.0  # one layer, one micro-batch: over a day is no timing
MAX_BYTES = 1 << 53  # byte counts stay exact as floats (8 PiB)

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
MaybeZeroSeconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
ByteCount = Annotated[int, Field(ge=0, le=MAX_BYTES)]


class BadCacheEntry(ValueError):
    """One-line reason a cache entry cannot be used."""


class _Strict(BaseModel):
    # strict: no "1" for 1, no true for 1; allow_inf_nan: 1e400 parses as inf, and NaN is refused.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class CachedLayer(_Strict):
    param_bytes: ByteCount
    activation_bytes: ByteCount
    output_bytes: ByteCount


class CacheEntry(_Strict):
    layer_seconds: list[Seconds] = Field(min_length=1)
    optimizer_seconds: list[MaybeZeroSeconds]
    codec_seconds_per_byte: dict[str, MaybeZeroSeconds]
    layers: list[CachedLayer]

    @model_validator(mode="after")
    def _consistent(self) -> "CacheEntry":
        n = len(self.layer_seconds)
        for name in ("optimizer_seconds", "layers"):
            if len(getattr(self, name)) != n:
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


def _no_constant(name: str):
    raise BadCacheEntry(f"{name} is not a JSON number")


def check_entry(data: object, num_layers: int | None = None) -> dict:
    """The entry as a plain dict if it is a usable one (for a model of `num_layers` layers,
    where the caller knows it); else BadCacheEntry with a one-line reason."""
    try:
        entry = CacheEntry.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise BadCacheEntry(f"{where}: {first['msg']}{more}") from None
    if num_layers is not None and len(entry.layer_seconds) != num_layers:
        raise BadCacheEntry(f"layer_seconds has {len(entry.layer_seconds)} entries for a model of {num_layers} layers")
    return entry.model_dump()


def parse_entry(raw: bytes, num_layers: int | None = None) -> dict:
    """Decode and check the bytes of a cache file; BadCacheEntry names what is wrong."""
    if len(raw) > MAX_ENTRY_BYTES:
        raise BadCacheEntry(f"over {MAX_ENTRY_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadCacheEntry("not UTF-8 text") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise BadCacheEntry(f"not valid JSON (line {err.lineno}): {err.msg}") from None
    except BadCacheEntry:
        raise
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise BadCacheEntry("a number with too many digits") from None
    except RecursionError:
        raise BadCacheEntry("nested too deeply") from None
    return check_entry(data, num_layers)


def _read(path: Path) -> bytes | None:
    """The file's bytes; None when there is no file. Never blocks (a FIFO) nor reads without bound."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadCacheEntry("not a regular file")
        return f.read(MAX_ENTRY_BYTES + 1)


def cached_node(key: str, num_layers: int | None = None, console=None) -> dict | None:
    """The cached entry for `key`, or None: none cached, or a bad one (reported on `console`
    in one line naming the file; the fresh measurement will replace it)."""
    path = cache_path(key)
    try:
        raw = _read(path)
        return None if raw is None else parse_entry(raw, num_layers)
    except (BadCacheEntry, OSError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        _warn(console, f"ignoring cached profile {path}: {reason}; measuring the node again")
        return None


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

        print(f"warning: {message}", file=sys.stderr, flush=True)
    else:
        console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)
