"""Which nodes average which layers' gradients when several pipelines train one model.

Pipelines may cut the model differently (pipeline 0: [0, 3) | [3, 6); pipeline 1:
[0, 2) | [2, 4) | [4, 6)). Every layer is held by exactly one stage of each pipeline;
the stages that hold a layer must sum its gradients before any optimizer steps. Layers
whose holders are the same set of stages form one sync group:

    layers 0-1: {p0.s0, p1.s0}   layer 2: {p0.s0, p1.s1}   layer 3: {p0.s1, p1.s1}   ...

Stages are contiguous, so as the layer index grows every pipeline's stage index only
grows: a holder set never comes back once it changed, and each group is one contiguous
layer range. One c10d group is made per sync group, once per plan generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SyncGroup:
    layer_start: int  # [layer_start, layer_end)
    layer_end: int
    holders: tuple[tuple[int, int], ...]  # (pipeline index, stage index), one per pipeline, in pipeline order


def hierarchy_applies(regions: Sequence[str]) -> bool:
    """Can a group whose holders sit in these regions sum hierarchically (inside each region, then
    between regions)? Only across two or more regions with some region holding two or more."""
    return len(set(regions)) >= 2 and len(set(regions)) < len(regions)


def sync_groups(cuts: list[list[tuple[int, int]]]) -> list[SyncGroup]:
    """Maximal layer runs with one holder set, given each pipeline's stage ranges. [] for one pipeline."""
    if len(cuts) < 2:
        return []
    num_layers = cuts[0][-1][1]
    for p, ranges in enumerate(cuts):
        if ranges[0][0] != 0 or ranges[-1][1] != num_layers or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"pipeline {p}'s stages {ranges} do not tile [0, {num_layers})")
    # The holder set changes exactly where some pipeline's stage starts, and each change makes a new
    # group: one group per run between consecutive starts (a walk over every layer was most of
    # planning 3,000 layers, where the polish prices thousands of sets).
    starts = sorted({start for ranges in cuts for start, _ in ranges if start < num_layers})
    groups: list[SyncGroup] = []
    position = [0] * len(cuts)  # each pipeline's stage holding the run's first layer
    for start, end in zip(starts, starts[1:] + [num_layers]):
        for p, ranges in enumerate(cuts):
            while ranges[position[p]][1] <= start:
                position[p] += 1
        groups.append(SyncGroup(start, end, tuple(enumerate(position))))
    return groups
