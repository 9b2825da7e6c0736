"""The join token: every control-plane RPC carries it as gRPC metadata."""

from __future__ import annotations

import os
from pathlib import Path

from hetlaunch.runtime.files import UnreadableFile, read_regular_file

TOKEN_METADATA_KEY = "x-hetlaunch-token"
TOKEN_ENV_VAR = "HETLAUNCH_TOKEN"
MAX_TOKEN_CHARS = 4096


def read_token(token_file: str | None) -> str:
    """The token from a file (first line), stdin's first line (file "-") or, without one, from $HETLAUNCH_TOKEN; ValueError
    with a one-line reason naming where it looked."""
    if token_file == "-":  # `up` starting an agent over SSH writes it here: never on a command line
        import sys

        return _checked(sys.stdin.buffer.readline(MAX_TOKEN_CHARS + 1), "the token on stdin",
                        missing="no join token on stdin")
    if token_file:
        path = Path(token_file)
        if path.is_dir():
            raise ValueError(f"token file {token_file} is a directory")
        try:  # a FIFO or a device is refused, not waited on
            raw = read_regular_file(path, MAX_TOKEN_CHARS)
        except FileNotFoundError:
            raise ValueError(f"token file {token_file} does not exist") from None
        except UnreadableFile as err:
            raise ValueError(f"token file {token_file}: {err}") from None
        return _checked(raw, f"token file {token_file}")
    return _checked(os.environ.get(TOKEN_ENV_VAR, "").encode("utf-8", "surrogateescape"), f"${TOKEN_ENV_VAR}",
                    missing=f"no join token: pass --token-file FILE or set ${TOKEN_ENV_VAR}")


def _checked(raw: bytes, where: str, missing: str | None = None) -> str:
    """A token travels as a gRPC header value: printable ASCII only, so a bad one fails here, by name,
    not later inside gRPC with "Illegal header value"."""
    lines = raw.strip().splitlines()
    token = lines[0].strip() if lines else b""
    if not token:
        raise ValueError(missing or f"{where} is empty")
    if len(raw) > MAX_TOKEN_CHARS:
        raise ValueError(f"{where}: a token is at most {MAX_TOKEN_CHARS} characters")
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ValueError(f"{where}: the token must be printable ASCII without spaces")
    return token.decode("ascii")
