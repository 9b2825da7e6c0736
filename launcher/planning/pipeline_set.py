"""A set of data-parallel pipelines as priced, and how micro-batches are split among them."""

from __future__ import annotations

from dataclasses import dataclass

from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.sync_cost import SyncCost


@dataclass
class PipelineSet:
    pipelines: list[PipelineCost]  # each at its own share of the micro-batches
    sync: list[SyncCost]
    step_s: float


def split_microbatches(total: int, throughputs: list[float]) -> list[int]:
    """Micro-batches per pipeline in proportion to throughput, each at least 1, summing to total."""
    if total < len(throughputs):
        raise ValueError(f"{total} micro-batches cannot give each of {len(throughputs)} pipelines one")
    raw = [total * t / sum(throughputs) for t in throughputs]
    counts = [max(1, int(r)) for r in raw]
    while sum(counts) > total:  # taken from those above one: a pipeline never drops to 0 (a slow one
        # whose raw share rounds to 1 while a fast one rounds down once made a 0 there: cost_model's ÷ 0)
        i = max((k for k in range(len(counts)) if counts[k] > 1), key=lambda k: counts[k] - raw[k])
        counts[i] -= 1
    while sum(counts) < total:
        i = max(range(len(counts)), key=lambda k: raw[k] - counts[k])
        counts[i] += 1
    return counts
