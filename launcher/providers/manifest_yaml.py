"""Kubernetes manifests as YAML text that kubectl reads back as written.

PyYAML writes YAML 1.1, whose resolver leaves strings such as 1e3, 0o17, 0123 or y unquoted
because it reads them as strings; kubectl's YAML reader (go-yaml, behind sigs.k8s.io/yaml) takes
them for numbers or booleans, where every field the manifests carry them in (labels, node
selectors, args, the Secret's data, its revision annotation) must be a string. Such strings are
double-quoted here (hostile reviews).
"""

from __future__ import annotations

import re

import yaml

# And y, Y, n, N: booleans to go-yaml v2 (sigs.k8s.io/yaml), plain strings to PyYAML.
_NUMBER_LIKE = re.compile(r"[-+]?(\.?[0-9]|\.(inf|Inf|INF|nan|NaN|NAN)$)|[yYnN]$")


class _ManifestDumper(yaml.SafeDumper):
    """SafeDumper, but every string that could read as a number is double-quoted."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if _NUMBER_LIKE.match(value):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    return dumper.represent_str(value)


_ManifestDumper.add_representer(str, _string)


def manifests_text(docs: list[dict]) -> str:
    """The documents as one multi-document YAML text, in their own key order."""
    return yaml.dump_all(docs, Dumper=_ManifestDumper, sort_keys=False)
