"""How much of a large cluster the plan puts to work: predicted tokens/s ÷ the cluster's ideal.

The ideal is the sum of every node's own tokens/s — each node training the whole model alone
at the plan's micro-batch size, memory, links, bubbles and gradient sync ignored — so no plan
reaches 1. The global batch is fixed (GLOBAL_BATCH samples of 2048 tokens, 8M tokens a
step); the planner chooses micro-batch size, count, pipelines and codecs with
`compression: auto`. Three versions of bench/planning_time.py's 256-node profile (4 device
types, 10 regions):

* synthetic — its links as they are: 200 Gbps inside a region, 0.8-16 Gbps and 10-120 ms
  between regions;
* 10 Gbps in regions — the same with 10 Gbps inside each region;
* links not the bottleneck — every link at least 10 Gbps and at most 1 ms.

Target (issue 14): ≥ 0.8 where links are not the bottleneck (the third).

Hierarchical sync (issue 25): each profile is planned twice, side by side — with
`sync_topology: ring` (every sync group one flat ring, as before) and with the default `auto`
(a group spanning regions may sum inside each region first) — the "before and after".

Islands (issue 25): the synthetic profile planned with `train.outer` (islands by region, H
chosen by the planner, int8 deltas): each region trains its own pipelines and the regions meet
every H steps. Target: utilization ≥ 0.85 with ≥ 90% of the nodes used, planning ≤ 5 s. Beside each figure:
how many nodes the plan uses, its pipelines, and how much of the step is gradient sync not
hidden by backward, which says where the rest goes.
"""

from __future__ import annotations

import time

from _harness import NullReporter, Reporter
from planning_time import synthetic_profile

from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.island_plans import ProfileCluster, plan_islands
from hetlaunch.launcher.planning.planner import plan_global_batch
from hetlaunch.launcher.planning.profile_file import LinkProfile, Profile
from hetlaunch.launcher.planning.request import PlanRequest
from hetlaunch.launcher.train_config import OuterConfig, TrainConfig

GLOBAL_BATCH = 4096
MAX_PIPELINES = 256
TARGET = 0.8


def _links(profile: Profile, inside: float | None = None, between: tuple[float, float] | None = None) -> Profile:
    links = []
    for link in profile.links:
        same = link.regions[0] == link.regions[1]
        bandwidth, latency = link.bandwidth_bytes_per_s, link.latency_s
        if same and inside is not None:
            bandwidth = inside
        if not same and between is not None:
            bandwidth, latency = max(bandwidth, between[0]), min(latency, between[1])
        links.append(LinkProfile(regions=link.regions, bandwidth_bytes_per_s=bandwidth, latency_s=latency))
    return profile.model_copy(update={"links": links})


def profiles() -> dict[str, Profile]:
    base = synthetic_profile(256, 10)
    ten_gbps = 10e9 / 8
    return {"synthetic": base,
            "10 Gbps in regions": _links(base, inside=ten_gbps),
            "links not the bottleneck": _links(base, between=(ten_gbps, 1e-3))}


def ideal_tokens_per_s(profile: Profile, micro_batch_size: int, num_microbatches: int) -> float:
    """Σ over nodes of one node's tokens/s on the whole model (per-token times, as the planner scales them)."""
    scale = micro_batch_size / profile.micro_batch_size
    tokens = micro_batch_size * profile.seq_len
    return sum(tokens / (sum(n.layer_seconds) * scale + sum(n.optimizer_seconds or []) / num_microbatches)
               for n in profile.nodes)


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    cases = profiles()
    reporter.total(len(cases) + 1)
    rows = {}
    tiers = {}
    for name, profile in cases.items():
        reporter.advance(f"plan {name}")
        rows[name] = _synchronous_row(profile, CompressionConfig())
        ring = _synchronous_row(profile, CompressionConfig(sync_topology="ring"))
        tiers[name] = {"ring only (before)": ring["utilization"], "auto (after)": rows[name]["utilization"],
                       "hierarchical_groups": rows[name]["hierarchical_groups"],
                       "sync_groups": rows[name]["sync_groups"], "ring_only_row": ring}
    reporter.advance("islands (synthetic)")
    islands = {"by region, defaults": _islands_row(cases["synthetic"], OuterConfig()),
               "by region, streaming (4 fragments, delay 1)": _islands_row(cases["synthetic"],
                                                                           OuterConfig(fragments=4, delay=1))}
    reporter.advance("done")
    figure = rows["links not the bottleneck"]["utilization"]
    return {
        "description": f"predicted tokens/s ÷ Σ nodes' own tokens/s for a fixed global batch of {GLOBAL_BATCH} "
                       f"samples, 256 nodes in 10 regions, compression auto, up to {MAX_PIPELINES} pipelines",
        "config": {"global_batch": GLOBAL_BATCH, "max_pipelines": MAX_PIPELINES, "nodes": 256, "regions": 10},
        "profiles": rows,
        "figure": {"name": "utilization where links are not the bottleneck", "value": figure,
                   "target": f">= {TARGET}"},
        "met": figure >= TARGET,
        "islands": islands,
        "hierarchical_sync": tiers,
    }


def _synchronous_row(profile: Profile, compression: CompressionConfig) -> dict:
    started = time.perf_counter()
    result = plan_global_batch(profile, GLOBAL_BATCH, "1f1b", max_pipelines=MAX_PIPELINES, compression=compression)
    ideal = ideal_tokens_per_s(profile, result.micro_batch_size, result.batch.num_microbatches)
    exposed = max((g.exposed_s for g in result.sync), default=0.0)
    return {
        "utilization": result.tokens_per_s / ideal,
        "predicted_tokens_per_s": result.tokens_per_s, "ideal_tokens_per_s": ideal,
        "micro_batch_size": result.micro_batch_size, "num_microbatches": result.batch.num_microbatches,
        "pipelines": len(result.pipelines), "stages_per_pipeline": [len(p.cost.stages) for p in result.pipelines],
        "nodes_used": len(profile.nodes) - len(result.excluded), "nodes": len(profile.nodes),
        "step_s": result.step_s, "slowest_pipeline_s": max(p.cost.step_s for p in result.pipelines),
        "sync_exposed_s": exposed, "sync_groups": len(result.sync),
        "hierarchical_groups": sum(g.hierarchical for g in result.sync), "planning_s": time.perf_counter() - started,
    }


def _islands_row(profile: Profile, outer: OuterConfig) -> dict:
    """The synthetic profile planned as islands by region (launcher/planning/island_plans.py)."""
    train = TrainConfig(micro_batch_size=profile.micro_batch_size, global_batch=GLOBAL_BATCH, outer=outer)
    request = PlanRequest(num_microbatches=1, schedule="1f1b", compression=CompressionConfig(),
                          max_pipelines=MAX_PIPELINES, global_batch=GLOBAL_BATCH)
    started = time.perf_counter()
    plan = plan_islands(ProfileCluster(profile, train), profile, request)
    planning_s = time.perf_counter() - started
    ideal = ideal_tokens_per_s(profile, plan.micro_batch_size, plan.num_microbatches)
    used = {s.node for s in plan.stages}
    o = plan.outer
    return {"utilization": plan.predicted_tokens_per_s / ideal, "predicted_tokens_per_s": plan.predicted_tokens_per_s,
            "ideal_tokens_per_s": ideal, "islands": len(plan.island_members()), "pipelines": len(plan.pipelines()),
            "nodes_used": len(used), "nodes": len(profile.nodes), "every": o.every if o else None,
            "exchange_s": o.exchange_s if o else None, "exposed_s": o.exposed_s if o else None,
            "step_s": plan.predicted_step_s, "micro_batch_size": plan.micro_batch_size,
            "num_microbatches": plan.num_microbatches, "island_microbatches": plan.island_microbatches(),
            "cross_region_bytes_per_step": (o.wire_bytes / o.every) if o else None, "planning_s": planning_s,
            "targets": {"utilization": ">= 0.85", "nodes_used": ">= 90%", "planning_s": "<= 5"}}
