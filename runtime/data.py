"""Deterministic token batches: from bytes of text (the zero-setup default) or from a token file.

A token file is nanoGPT's format: a flat array of uint16 or uint32 token ids, no header,
memory-mapped so a corpus larger than memory costs only the windows drawn from it
(`hetlaunch prepare-data` writes one from text; runtime/token_file.py opens it and checks every
id against the vocabulary once, when it is opened). Every stage that needs data (the first stage for inputs, the last for targets)
builds its own ``TokenBatches`` from the same bytes and seed; because a batch
depends only on ``(seed, step)``, the two processes agree on every batch without
sending tokens to each other, whatever order they ask for steps in.

The default text is the installed Python standard library's source: real text
on every machine, nothing downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import torch
from torch import Tensor

from hetlaunch.runtime.default_text import stdlib_text_bytes
from hetlaunch.runtime.token_file import check_token_ids, regular_data_file, token_file


def text_file(path: str) -> np.ndarray:
    """A user text file's bytes (a token a byte), memory-mapped read-only as a token file is;
    refuses missing, non-regular or empty files. Read whole, a 1.5 GB corpus took 3.4 GB in
    every stage (the bytes, then a copy for torch)."""
    p = regular_data_file(path)
    if p.stat().st_size == 0:
        raise ValueError(f"data file {path!r} is empty")
    return np.memmap(p, dtype=np.uint8, mode="r")


def batch_seed(seed: int, step: int) -> int:
    # Hash so that (seed, step) pairs never collide and any int seed is accepted.
    digest = hashlib.blake2b(f"hetlaunch-data:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TokenBatches:
    """Random windows of ``seq_len + 1`` tokens; inputs are the first ``seq_len``, targets the
    last ``seq_len`` (inputs shifted by one). The windows of step s are nanoGPT's ``get_batch``
    under ``torch.manual_seed(step seed)``: starts drawn uniformly from [0, len - seq_len)."""

    def __init__(self, data: bytes | np.ndarray, seq_len: int, seed: int, vocab_size: int | None = None,
                 source: str = "the data") -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(data) < seq_len + 2:
            raise ValueError(
                f"{source} has {len(data)} tokens; need at least seq_len + 2 = {seq_len + 2} "
                "to draw more than one distinct window"
            )
        if isinstance(data, np.ndarray):
            self._tokens = data  # memory-mapped: read only where windows fall
        else:  # uint8 keeps the corpus at one byte per token; windows are widened on gather.
            self._tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self.vocab_size = vocab_size
        self.source = source
        self._window = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return len(self._tokens)

    def _windows(self, offsets: Tensor) -> Tensor:
        if isinstance(self._tokens, np.ndarray):
            self._check_file_whole()
            rows = [self._tokens[o:o + self.seq_len + 1] for o in offsets.tolist()]
            windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        else:
            windows = self._tokens[offsets[:, None] + self._window].long()
        if self.vocab_size is not None and windows.numel() and int(windows.max()) >= self.vocab_size:
            raise ValueError(f"{self.source} holds token id {int(windows.max())}, outside the model's "
                             f"vocabulary of {self.vocab_size} (ids 0..{self.vocab_size - 1})")
        return windows

    def _check_file_whole(self) -> None:
        """Refuse in one line a memory-mapped file cut short since it was opened: a read past its
        new end is SIGBUS, which kills the worker without a word. (One fstat a batch. A file
        replaced by a rename keeps the old one mapped, whole, and is not noticed.)"""
        mapping = getattr(self._tokens, "_mmap", None)
        if mapping is None:
            return
        now = mapping.size()  # the file's length now; len(mapping) is what was mapped
        if now < len(mapping):
            raise ValueError(f"{self.source} shrank from {len(mapping)} to {now} bytes while training "
                             "(truncated or rewritten in place); write a new file and rename it over the old one")

    def batch(self, step: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets), each int64 [batch_size, seq_len], on CPU."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        gen = torch.Generator().manual_seed(batch_seed(self.seed, step))
        # Window start in [0, len - seq_len - 1] so the window's last token exists.
        offsets = torch.randint(0, len(self) - self.seq_len, (batch_size,), generator=gen)
        windows = self._windows(offsets)
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


def open_data(path: str, data_format: str, dtype: str, seq_len: int, seed: int, vocab_size: int | None,
              eval_fraction: float = 0.0) -> tuple[TokenBatches, TokenBatches | None]:
    """Training batches and, when `eval_fraction` > 0, batches of the held-out tail of the data
    (the last `eval_fraction` of it, never trained on)."""
    if data_format == "tokens":
        data, source = token_file(path, dtype), f"data file {path!r}"
        if vocab_size is not None:  # every id, before training: a bad one deep in the file must not wait for its draw
            check_token_ids(data, vocab_size, source)
    elif data_format in ("", "text"):
        data = text_file(path) if path else stdlib_text_bytes()
        source = f"data file {path!r}" if path else "the standard library's text"
        if vocab_size is not None and vocab_size < 256:  # a byte a token: one byte too big crashed step 140
            check_token_ids(np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data, vocab_size, source)
    else:
        raise ValueError(f"data.format {data_format!r} is not one of text, tokens")
    if not eval_fraction:
        return TokenBatches(data, seq_len, seed, vocab_size, source), None
    cut = int(len(data) * (1.0 - eval_fraction))
    held_out = f"{source} (its held-out last {eval_fraction:g})"
    return (TokenBatches(data[:cut], seq_len, seed, vocab_size, source),
            TokenBatches(data[cut:], seq_len, seed + 1, vocab_size, held_out))


@contextlib.contextmanager
def token_ids_named(first: bool, inputs):
    """Around the first layers' forward: an IndexError they raise names the batch's largest token
    id. A model that names no vocabulary (no vocab_size kwarg, no LayeredModel.vocab_size) has
    its ids checked by nothing before training, and an id past its embedding ended the run with
    only "IndexError: index out of range in self"."""
    try:
        yield
    except IndexError as err:
        if not first or not isinstance(inputs, Tensor) or inputs.is_floating_point() or inputs.numel() == 0:
            raise
        raise IndexError(f"{err} (in the first stage's layers, on a batch of token ids up to {int(inputs.max()):,}: "
                         f"is an id at or past the model's vocabulary? Ids are checked before training only "
                         f"where the model names its vocabulary: a vocab_size kwarg or LayeredModel.vocab_size)") from err
