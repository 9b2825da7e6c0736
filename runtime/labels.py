"""An agent's discovery labels (`hetlaunch agent --label KEY=VALUE`), matched by the YAML's discover.labels."""

from __future__ import annotations

import re

LABEL_KEY = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
MAX_LABEL_VALUE = 256


def parse_labels(pairs: list[str]) -> dict[str, str]:
    """--label flags as a dict; ValueError naming the bad one."""
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(LABEL_KEY, key) or len(value) > MAX_LABEL_VALUE:
            raise ValueError(f"--label must be KEY=VALUE, KEY of letters, digits, '_', '.', '-' and VALUE at most "
                             f"{MAX_LABEL_VALUE} characters (got {pair[:80]!r})")
        labels[key] = value
    return labels
