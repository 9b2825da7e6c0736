"""Text that came from another process or host, made safe to print on a terminal.

A worker's failure, an agent's hostname, a profile's error: any of them may carry ANSI or OSC
escape sequences (a model's exception text, a hostile agent) that would recolour, retitle or
rewrite the user's terminal. Rich markup is already printed literally (rich.text.Text); control
characters are not, so they are shown here as escapes (\\x1b), never sent as they are."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 (but \t, \n) and C1, DEL


def plain(text: str, limit: int = 4000) -> str:
    """`text` with every control character but tab and newline escaped, cut to `limit` characters."""
    return _escaped(_CONTROL, text if len(text) <= limit else text[:limit] + "...")


# and U+2028, U+2029: YAML (and JavaScript) break lines at them, so in a rendered manifest's comment
# they ended the comment and what followed became keys of the manifest (a hostile review's -o path).
_ANY_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """`text` (a path, a name) with every control character escaped, newline and tab included: for
    a line of output or a comment in a written file, where a newline in a file name would start a
    line of its own (a `kind:` of its own, in a rendered manifest)."""
    return _escaped(_ANY_CONTROL, text)


def _escaped(pattern: re.Pattern, text: str) -> str:
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) <= 0xFF else f"\\u{ord(m.group()):04x}",
                       text)
