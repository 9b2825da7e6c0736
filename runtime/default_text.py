"""The text a job trains on without `data.path`: the installed Python standard library's sources.

Torch-free (stdlib only), so `hetlaunch validate` can check it against a model's vocabulary the
way the stages read it (runtime/data.py: a token a byte) without loading torch.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

# Directory names whose contents are not representative source (or not stdlib at all).
_SKIP_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__"})


@functools.lru_cache(maxsize=4)
def stdlib_text_bytes(max_bytes: int = 4_000_000) -> bytes:
    """Concatenated stdlib ``*.py`` files, sorted by relative path, truncated to ``max_bytes``."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = sysconfig.get_paths()["stdlib"]
    found: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into site-packages (often
        # gigabytes of installed packages) or test suites.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                found.append((rel.replace(os.sep, "/"), os.path.join(dirpath, name)))
    # Sort by relative POSIX path, so the order is a property of the install,
    # not of the file system's directory listing order.
    paths = [Path(full) for _, full in sorted(found)]
    chunks: list[bytes] = []
    total = 0
    for path in paths:
        if total >= max_bytes:
            break
        if not path.is_file():
            continue
        chunk = path.read_bytes() + b"\n"
        chunks.append(chunk)
        total += len(chunk)
    if total == 0:
        raise RuntimeError(f"no Python source files found under the standard library at {root}")
    return b"".join(chunks)[:max_bytes]
