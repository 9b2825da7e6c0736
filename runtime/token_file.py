"""Token files (nanoGPT's format: a flat array of uint16 or uint32 ids, no header), opened as a
read-only memory map, and every id in one checked against a vocabulary. numpy only, no torch,
so `hetlaunch validate` and `up` check a file without loading torch.

Why check every id: batches check only the windows they draw, so one id past the vocabulary
deep in a file passes a short run and kills a long one hours in (issue 23). The check is one
vectorised pass over the file, read a chunk at a time (not through the map: memory stays bounded
however large the file, and a file cut shorter meanwhile is an error, not SIGBUS): 0.27 s per GB
of uint16 or uint32 ids on this project's 2-core VM with the file in the page cache (0.15 and 0.07
through the map; `python bench/run.py token_check`); from a cold disk the read dominates, at the
disk's own speed. The file is opened again by its name to be read: one swapped in between the
map and the check is the one checked (the batches still check every window they draw).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}

# Tokens per vectorised step: 32 MiB of uint16 at a time, small beside any memory, large enough
# that the per-chunk overhead is nothing.
CHUNK_TOKENS = 1 << 24


def regular_data_file(path: str) -> Path:
    """A data file's path, refused in one line where it is missing or not a regular file (a
    FIFO or a device is never mapped)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    if not p.is_file():
        raise ValueError(f"data file {path!r} is not a regular file")
    return p


def token_file(path: str, dtype: str) -> np.ndarray:
    """A token file, memory-mapped read-only; refuses one that is missing, empty or cut mid-token."""
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    p = regular_data_file(path)
    size, itemsize = p.stat().st_size, np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size == 0 or size % itemsize:
        raise ValueError(f"data file {path!r} has {size} bytes, not a whole number of {dtype} tokens "
                         f"({itemsize} bytes each)")
    return np.memmap(p, dtype=TOKEN_DTYPES[dtype], mode="r")


def first_id_outside(tokens: np.ndarray, vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first id >= vocab_size, or None when every id is below it. A memory
    map is read through its file a chunk at a time, not through the map: a file cut shorter while
    it was checked killed `validate` with SIGBUS (a review), and the pages read stayed mapped (4 GB
    resident for a 4 GiB file); a short read is one line instead."""
    for start, chunk in _chunks(tokens):
        if int(chunk.max()) >= vocab_size:  # the fast pass; the position only once one is known bad
            at = int(np.argmax(chunk >= vocab_size))
            return start + at, int(chunk[at])
    return None


def _head(tokens: np.ndarray, count: int) -> np.ndarray:
    """The first `count` ids (fewer, in whole pairs, where a mapped file shrank), as _chunks reads them."""
    path = _mapped_file(tokens)
    if path is None:
        return np.asarray(tokens[:count])
    with open(path, "rb") as f:
        f.seek(tokens.offset)
        head = np.fromfile(f, dtype=tokens.dtype, count=count)
    return head[:len(head) // 2 * 2]


def _mapped_file(tokens: np.ndarray) -> str | None:
    """The file under a memory map of a whole file from its offset; None for anything else (a view
    of one keeps the map's offset, which numpy does not move with the view)."""
    whole = isinstance(tokens, np.memmap) and isinstance(tokens.base, mmap.mmap) and tokens.filename
    return tokens.filename if whole else None


def _chunks(tokens: np.ndarray):
    """(first position, ids) of CHUNK_TOKENS ids at a time: read from the file under a memory map
    of a whole file (_mapped_file), else from the array."""
    path = _mapped_file(tokens)
    if path is None:
        for start in range(0, len(tokens), CHUNK_TOKENS):
            yield start, tokens[start:start + CHUNK_TOKENS]
        return
    with open(path, "rb") as f:
        f.seek(tokens.offset)
        for start in range(0, len(tokens), CHUNK_TOKENS):
            want = min(CHUNK_TOKENS, len(tokens) - start)
            chunk = np.fromfile(f, dtype=tokens.dtype, count=want)
            if len(chunk) < want:
                raise ValueError(f"data file {path!r} shrank while its ids were checked: {start + len(chunk):,} "
                                 f"of {len(tokens):,} tokens left")
            yield start, chunk


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Raise one line naming the first id outside [0, vocab_size), its position and the vocabulary;
    or, for 16-bit ids, saying the file looks 32-bit (read_as_narrower)."""
    if read_as_narrower(tokens, vocab_size):
        raise ValueError(f"{source} looks like a uint32 token file read as uint16: every other id is the high "
                         f"half of a 32-bit one (at most {(vocab_size - 1) >> 16}); set data.dtype: uint32")
    found = first_id_outside(tokens, vocab_size)
    if found is not None:
        position, token = found
        raise ValueError(f"{source} holds token id {token}, outside the model's vocabulary of {vocab_size} "
                         f"(ids 0..{vocab_size - 1}), at position {position} of {len(tokens)}")


def read_as_narrower(tokens: np.ndarray, vocab_size: int, sample: int = 1 << 16) -> bool:
    """Whether 16-bit ids look like a 32-bit file's halves: prepare-data writes uint32 for a
    vocabulary past 65,536 (Llama 3's 128,256), and read with the default uint16 every other id is
    a high half (0 or 1), all below the vocabulary, so the check of ids passed and training ran on
    garbage (a review). Real text has no id that small at every odd place of its first 65,536."""
    # Any vocabulary: under 65,536 ids the high halves are all 0 (a uint32 file of GPT-2's 50,257
    # read as uint16 passed as "every id below the vocabulary"; a review). Fewer than 32 ids say too
    # little to tell.
    if tokens.dtype != np.uint16 or len(tokens) < 32:
        return False
    head = _head(tokens, min(len(tokens), sample) // 2 * 2)  # whole pairs of 16-bit halves
    if len(head) < 32:
        return False  # the file shrank under it: first_id_outside says so
    high = (vocab_size - 1) >> 16
    return bool(head[1::2].max() <= high < head[0::2].max())
