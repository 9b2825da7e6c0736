"""`hetlaunch prepare-data`: tokenize a text file into a token file (nanoGPT's format: a flat
array of uint16 or uint32 ids, no header) that `data: {format: tokens}` trains on.

The tokenizer comes from the `tokenizers` package (the `hetlaunch[data]` extra): a
`tokenizer.json` file, or a name on the Hugging Face hub (from its local cache, else the network). The text is
read and encoded in chunks cut at line ends, so a corpus larger than memory works, with a
progress bar; the output is written whole or not at all (runtime/files.py whole_file_beside: a
file with no name until it is whole, so even a SIGKILL mid-way leaves nothing behind).
"""

from __future__ import annotations

import socket
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import numpy as np

from hetlaunch.launcher.config_types import home_path
from hetlaunch.runtime.files import UnreadableFile, read_regular_file, whole_file_beside

CHUNK_BYTES = 4 * 2**20
MAX_TOKENIZER_BYTES = 256 << 20  # the largest hub tokenizer.json files are tens of MB
HUB_CONNECT_TIMEOUT_S = 5.0


class PrepareError(Exception):
    """Bad input for prepare-data, said in one line."""


@dataclass
class Prepared:
    tokens: int
    vocab_size: int
    dtype: str


def load_tokenizer(name: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError("prepare-data needs the tokenizers package: pip install 'hetlaunch[data]'") from None
    try:
        given = home_path(name)
    except ValueError as err:
        raise PrepareError(f"--tokenizer {err}") from None
    path = given / "tokenizer.json" if given.is_dir() else given
    # A path, not a hub name ("gpt2", "org/name"): asking the hub for a mistyped file took 24 s of retries.
    local = given.is_dir() or given.is_absolute() or name.startswith((".", "~")) or given.suffix == ".json"
    if local and not path.exists():
        raise PrepareError(f"{path}: no such tokenizer file")
    if not path.exists():
        path = _from_hub(name)
    try:  # never waited on (a FIFO) nor read without end (/dev/zero grew to 23 GB)
        raw = read_regular_file(path, MAX_TOKENIZER_BYTES)
        return Tokenizer.from_str(raw.decode("utf-8"))
    except UnreadableFile as err:
        raise PrepareError(f"{path}: {err}") from None
    except Exception as err:  # the library's own parse errors, whatever their type
        raise PrepareError(f"{path} is not a tokenizer.json the tokenizers package can read: "
                           f"{' '.join(str(err).split())[:300]}") from None


def _from_hub(name: str) -> Path:
    """The hub tokenizer's tokenizer.json: from the local Hugging Face cache if it is there, else
    downloaded, once the hub was found reachable (unless a proxy stands between: then the
    download goes through it as the hub client sends it). Asked directly, the hub client retried an
    unreachable hub for 24 s before the error, even for a cached tokenizer."""
    try:  # the tokenizers package's own dependency; it reads HF_ENDPOINT as it is imported
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.utils import validate_repo_id
    except Exception as err:
        raise PrepareError(f"tokenizer {name!r}: the Hugging Face hub client cannot start "
                           f"({' '.join(str(err).split())[:200]}; is HF_ENDPOINT a URL?)") from None
    try:
        validate_repo_id(name)
    except ValueError as err:  # the hub's own name rules
        raise PrepareError(f"tokenizer {name!r} is neither a tokenizer.json file, a directory holding one, nor a "
                           f"hub name: {' '.join(str(err).split())[:200]}") from None
    try:
        return Path(hf_hub_download(name, "tokenizer.json", local_files_only=True))
    except Exception:  # not cached
        pass
    prefix = f"tokenizer {name!r} is neither a tokenizer.json file nor a directory holding one, nor in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise PrepareError(f"{prefix}, and HF_HUB_OFFLINE is set")
    unreachable = _unreachable(constants.ENDPOINT)
    if unreachable:
        raise PrepareError(f"{prefix}, and {unreachable}")
    try:
        return Path(hf_hub_download(name, "tokenizer.json"))
    except Exception as err:
        raise PrepareError(f"{prefix}, and fetching it from the hub failed: {' '.join(str(err).split())[:300]}") from None


def _unreachable(endpoint: str) -> str | None:
    """Why the hub at `endpoint` cannot be reached, or None where it answers a TCP connection or
    a proxy stands between (the client then reaches it through that proxy: not checked here)."""
    try:
        parts = urlsplit(endpoint)
        host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
    except ValueError as err:  # a port out of range or not a number
        return f"the hub endpoint {endpoint!r} is not a URL ({err})"
    proxies = urllib.request.getproxies()  # HTTPS_PROXY, ALL_PROXY, ... in either case
    if proxies.get(parts.scheme) or proxies.get("all"):
        # Whether the hub client's own reading of NO_PROXY sends it through is its own (httpx's
        # differs from urllib's): a check that dialled the hub here failed where the client got through.
        return None
    try:
        socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as err:
        return f"the hub ({host}:{port}) cannot be reached: {err.strerror or err}"
    return None


def _chunks(path: Path, size: int):
    """The file's bytes in pieces of about `size`, each ending after a newline, so no token spans
    two pieces; a line longer than `size` is cut before a UTF-8 character, never inside one."""
    tail = b""
    with path.open("rb") as f:
        while block := f.read(size):
            block = tail + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # back off continuation bytes (10xxxxxx) to a character's first byte
                cut = len(block)
                while cut > 0 and block[cut - 1] & 0xC0 == 0x80:
                    cut -= 1
                if cut > 0 and block[cut - 1] >= 0xC0:
                    cut -= 1
                cut = cut or len(block)
            tail = block[cut:]
            yield block[:cut]
    if tail:
        yield tail


def prepare(text_path: Path, tokenizer_name: str, output: Path,
            advance: Callable[[int], None] = lambda n: None) -> Prepared:
    """Tokenize `text_path` into `output`; `advance(bytes)` is called as the text is read."""
    if not text_path.is_file():
        raise PrepareError(f"{text_path} is not a readable file")
    if text_path.stat().st_size == 0:
        raise PrepareError(f"{text_path} is empty")
    if output.exists() and not output.is_file():  # a device named by -o was replaced by a plain file
        raise PrepareError(f"{output} exists and is not a regular file")
    if output.exists() and output.samefile(text_path):
        raise PrepareError(f"{output}: is the text file itself; the token file goes elsewhere")
    tokenizer = load_tokenizer(tokenizer_name)
    # A tokenizer.json may carry truncation or padding (some on the hub do): each 4 MiB piece was cut
    # to 512 tokens, or 15 tokens padded to 100,000, and the file written without a word (a review).
    tokenizer.no_truncation()
    tokenizer.no_padding()
    # The ids' bound, not the entries' count: a vocabulary {hello: 70000, ...} of 3 entries gave
    # uint16 and an OverflowError (or, at 60000, a vocabulary of 3 for ids up to 60000).
    ids_bound = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), ids_bound)
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    output.parent.mkdir(parents=True, exist_ok=True)
    tokens = offset = 0
    with whole_file_beside(output) as out:
        for chunk in _chunks(text_path, CHUNK_BYTES):
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PrepareError(f"{text_path} is not UTF-8 text ({err.reason} at byte {offset + err.start:,})") from None
            try:
                encoded = tokenizer.encode(text, add_special_tokens=False).ids
            except Exception as err:  # the library's own, whatever their type (a WordLevel without its unk token)
                raise PrepareError(f"the tokenizer failed on {text_path} near byte {offset:,}: "
                                   f"{' '.join(str(err).split())[:300]}") from None
            ids = np.asarray(encoded, dtype=dtype)
            out.write(ids.tobytes())
            tokens += ids.size
            offset += len(chunk)
            advance(len(chunk))
        if tokens < 2:
            raise PrepareError(f"{text_path} gave {tokens} token(s); training needs more")
    return Prepared(tokens=tokens, vocab_size=vocab_size, dtype=dtype)
