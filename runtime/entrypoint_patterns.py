"""Which model entrypoints may be imported: fnmatch patterns on "module:function". Shared by the
agent's policy, `export` and `validate`; free of torch and protobuf, so `validate` loads neither
for it (tests/job/test_import_rules.py)."""

from __future__ import annotations

import fnmatch

OWN_ENTRYPOINTS = ("hetlaunch.models.*",)  # hetlaunch's own model code: what export and validate import unasked


def entrypoint_allowed(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether "module:function" matches one of the fnmatch `patterns`."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
