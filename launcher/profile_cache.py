"""The profile cache: per-node layer timings keyed by what they depend on, so `up` measures a node once.

One JSON file per key under $HETLAUNCH_CACHE_DIR (default ~/.cache/hetlaunch/profiles).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("HETLAUNCH_CACHE_DIR", Path.home() / ".cache" / "hetlaunch")) / "profiles"


def node_cache_key(**identity: object) -> str:
    """Device type, emulation, model and micro-batch shape: what a layer timing depends on."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def cached_node(key: str) -> dict | None:
    path = cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def store_node(key: str, entry: dict) -> None:
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{key}.json.tmp"
    tmp.write_text(json.dumps(entry))
    os.replace(tmp, directory / f"{key}.json")
