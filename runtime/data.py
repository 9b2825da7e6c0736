"""Deterministic byte-level token batches.

Every stage that needs data (the first stage for inputs, the last for targets)
builds its own ``TokenBatches`` from the same bytes and seed; because a batch
depends only on ``(seed, step)``, the two processes agree on every batch without
sending tokens to each other, whatever order they ask for steps in.

The default text is the installed Python standard library's source: real text
on every machine, nothing downloaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from pathlib import Path

import torch
from torch import Tensor

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


def file_text_bytes(path: str) -> bytes:
    """The bytes of a user text file, refusing missing, non-regular or empty files."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if not p.is_file():
        raise ValueError(f"data file {path!r} is not a regular file")
    data = p.read_bytes()
    if not data:
        raise ValueError(f"data file {path!r} is empty")
    return data


def _step_seed(seed: int, step: int) -> int:
    # Hash so that (seed, step) pairs never collide and any int seed is accepted.
    digest = hashlib.blake2b(f"hetlaunch-data:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TokenBatches:
    """Random windows of ``seq_len + 1`` bytes; inputs are the first ``seq_len``,
    targets the last ``seq_len`` (inputs shifted by one)."""

    def __init__(self, data: bytes, seq_len: int, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(data) < seq_len + 2:
            raise ValueError(
                f"data has {len(data)} bytes; need at least seq_len + 2 = {seq_len + 2} "
                "to draw more than one distinct window"
            )
        # uint8 keeps the corpus at one byte per token; windows are widened on gather.
        self._tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self._window = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return self._tokens.numel()

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), each int64 [batch_size, seq_len], on CPU."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        gen = torch.Generator().manual_seed(_step_seed(self.seed, step))
        # Window start in [0, len - seq_len - 1] so the window's last byte exists.
        offsets = torch.randint(0, len(self) - self.seq_len, (batch_size,), generator=gen)
        windows = self._tokens[offsets[:, None] + self._window].long()
        # contiguous: these tensors may be sent over a link as they are.
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def micro_batches(
        self, step: int, micro_batch_size: int, num_microbatches: int
    ) -> list[tuple[Tensor, Tensor]]:
        """``batch(step, micro_batch_size * num_microbatches)`` cut into consecutive chunks,
        so the global batch of a step does not depend on how it is split."""
        if micro_batch_size < 1 or num_microbatches < 1:
            raise ValueError(
                f"micro_batch_size and num_microbatches must be >= 1, got {micro_batch_size}, {num_microbatches}"
            )
        inputs, targets = self.batch(step, micro_batch_size * num_microbatches)
        return list(zip(inputs.split(micro_batch_size), targets.split(micro_batch_size)))
