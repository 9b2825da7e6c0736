"""Edits to a profile that the job makes as it learns more than profiling measured.

Calibration (a node computes slower in training than alone), the straggler watch (a node
changed speed mid-run) and contention (nodes on one host share its cores) all say the same
thing of a node: its layers and its optimizer step take `factor` times as long as profiled.
"""

from __future__ import annotations

import math
from typing import Mapping

from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile, ProfileError


def scaled(profile: Profile, factors: Mapping[str, float], forget_hosts: bool = False) -> Profile:
    """`profile` with each node named in `factors` computing that many times as long. With
    `forget_hosts`, every node forgets its host: times that already carry their host's
    contention must not be stretched for it again when the result is priced."""
    nodes = []
    for node in profile.nodes:
        update: dict = {"host": None} if forget_hosts else {}
        factor = factors.get(node.name, 1.0)
        if not (math.isfinite(factor) and factor > 0):  # a measured ratio of nothing, or of nonsense
            raise ProfileError(f"node {node.name}: a speed factor must be a positive number, got {factor}")
        if factor != 1.0:
            update.update(_times(node, factor))
        nodes.append(node.model_copy(update=update) if update else node)
    return profile.model_copy(update={"nodes": nodes})


def _times(node: NodeProfile, factor: float) -> dict:
    return {name: None if getattr(node, name) is None else [t * factor for t in getattr(node, name)]
            for name in ("layer_seconds", "optimizer_seconds", "input_grad_seconds", "weight_grad_seconds")}


def subset(profile: Profile, names: list[str]) -> Profile:
    """The profile of `names` only: their nodes and the links among them."""
    return profile.model_copy(update={
        "nodes": [n for n in profile.nodes if n.name in names],
        "links": [link for link in profile.links if link.nodes is None or set(link.nodes) <= set(names)]})
