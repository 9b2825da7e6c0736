"""Islands: which nodes train together every step, and what their outer exchange costs.

An island is today's job on a subset of the nodes: one or more pipelines that sync gradients
every step. Islands meet only every H inner steps, for an outer step (runtime/outer_sync.py):
each layer's holders in every island exchange their change since the last outer step. The YAML
asks for islands (`train.outer`) and says how nodes group: one island per region, or lists.

Torch-free and in `planning/`: the planner and the offline `hetlaunch plan` use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from hetlaunch.runtime.registry import codec_info

OUTER_SHARE = 0.05  # every: auto: the smallest H whose exposed exchange is <= this share of H inner steps
DEFAULT_EVERY = 50  # every: auto on a plan nothing priced (pinned layers, no profile)


@dataclass(frozen=True)
class OuterPlan:
    """The outer steps of a plan with islands, as the stages run them."""

    every: int
    lr: float = 0.7
    momentum: float = 0.9
    codec: str = "int8"
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    every_source: str = "pinned"  # "pinned", "planned" (the smallest H that costs <= 5%), "capped" (at train.steps), "default"
    exchange_s: float | None = None  # predicted: one whole-model exchange on its slowest links
    exposed_s: float | None = None   # of it, what training waits for per H steps
    wire_bytes: float | None = None  # bytes every holder sends per whole-model exchange, summed over holders


def island_groups(setting, nodes: Sequence[tuple[str, str]]) -> list[list[str]]:
    """Node names per island, for `train.outer.islands` over (name, region) pairs in YAML order:
    `by_region` (regions in order of first use), or the YAML's lists restricted to `nodes`."""
    if setting == "by_region":
        regions: dict[str, list[str]] = {}
        for name, region in nodes:
            regions.setdefault(region, []).append(name)
        return list(regions.values())
    present = {name for name, _ in nodes}
    return [[n for n in island if n in present] for island in setting if any(n in present for n in island)]


class IslandError(ValueError):
    """A pinned pipeline that spans two islands."""


def pipeline_islands(pipelines: Iterable[Sequence[str]], groups: list[list[str]]) -> tuple[int, ...]:
    """Each pipeline's island index (islands renumbered 0, 1, ... in order of first use); IslandError
    for a pipeline whose nodes are in two islands. () when every pipeline is in one island."""
    island_of = {name: i for i, group in enumerate(groups) for name in group}
    raw = []
    for p, nodes in enumerate(pipelines):
        found = sorted({island_of[n] for n in nodes if n in island_of})
        if len(found) != 1:
            raise IslandError(f"pipeline {p} ({', '.join(nodes)}) spans islands "
                              f"{' and '.join(str(groups[i]) for i in found) or '(none)'}: a pipeline trains in one island")
        raw.append(found[0])
    order = list(dict.fromkeys(raw))
    if len(order) < 2:
        return ()
    return tuple(order.index(i) for i in raw)


@dataclass(frozen=True)
class ExchangeGroup:
    """One layer range's outer exchange: its parameter bytes (fp32) and its holders' links."""

    param_bytes: float
    holders: tuple[str, ...]            # the islands' representatives: one node per island
    bandwidth_bytes_per_s: float        # the slowest link between two holders
    latency_s: float


def exchange_seconds(groups: list[ExchangeGroup], codec: str) -> tuple[float, float]:
    """(seconds, bytes) of one whole-model outer exchange: every holder all-gathers its encoded
    delta ((k - 1) copies over its group's slowest link); a node's groups queue on its links, so the
    exchange takes as long as the busiest node's sum. Bytes: what all holders send in all."""
    info = codec_info(codec)
    busy: dict[str, float] = {}
    total_bytes = 0.0
    for group in groups:
        k = len(group.holders)
        payload = info.wire_bytes(max(1, int(group.param_bytes // 4)), 4)
        seconds = (k - 1) * payload / group.bandwidth_bytes_per_s + group.latency_s
        for node in group.holders:
            busy[node] = busy.get(node, 0.0) + seconds
        total_bytes += k * (k - 1) * payload
    return max(busy.values(), default=0.0), total_bytes


def exposed_seconds(exchange_s: float, step_s: float, fragments: int, delay: int) -> float:
    """What H inner steps wait for the exchanges of all fragments: all of it without a delay;
    with one, each fragment's share less the `delay` steps it overlaps."""
    if delay == 0:
        return exchange_s
    return fragments * max(0.0, exchange_s / fragments - delay * step_s)


def choose_every(exchange_s: float, step_s: float, fragments: int, delay: int) -> int:
    """The smallest H whose exposed exchange is <= OUTER_SHARE of H inner steps, and whose link
    can carry the whole model once per H steps; at least delay + 1."""
    if step_s <= 0:
        return DEFAULT_EVERY
    exposed = exposed_seconds(exchange_s, step_s, fragments, delay)
    return max(delay + 1, math.ceil(exposed / (OUTER_SHARE * step_s) - 1e-9), math.ceil(exchange_s / step_s - 1e-9), 1)
