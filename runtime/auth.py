"""The join token: every control-plane RPC carries it as gRPC metadata."""

from __future__ import annotations

import os
from pathlib import Path

TOKEN_METADATA_KEY = "x-hetlaunch-token"
TOKEN_ENV_VAR = "HETLAUNCH_TOKEN"


def read_token(token_file: str | None) -> str:
    """The token from a file (first line) or, without one, from $HETLAUNCH_TOKEN."""
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise ValueError(f"token file {token_file} does not exist")
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    token = os.environ.get(TOKEN_ENV_VAR, "").strip()
    if not token:
        raise ValueError(f"no join token: pass --token-file FILE or set ${TOKEN_ENV_VAR}")
    return token
