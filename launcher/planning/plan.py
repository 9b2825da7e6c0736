"""A plan: which node runs which contiguous layer range, in which order, with which codecs.

A plan is plain data so that it can be produced anywhere: from pinned `layers:` in the
YAML, by an even split (this file), or by the measured planner. It holds one or more
pipelines (data-parallel replicas, each with its own cut and its share of the step's
micro-batches); `stages` lists them pipeline after pipeline, and a stage's position in
that list is its data-plane rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from hetlaunch.launcher.planning.batch_sizes import describe
from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.islands import DEFAULT_EVERY, OuterPlan, island_groups, pipeline_islands
from hetlaunch.launcher.planning.sync_groups import hierarchy_applies, sync_groups
from hetlaunch.runtime.registry import AUTO_SCHEDULE, AUTO_SCHEDULES
from hetlaunch.runtime.schedules import own_window


@dataclass(frozen=True)
class StagePlan:
    node: str
    region: str
    layer_start: int  # [layer_start, layer_end)
    layer_end: int
    forward_codec: str = "none"   # codec for activations sent to the next stage
    backward_codec: str = "none"  # codec for gradients sent to the previous stage
    # What the planner predicts (None for a cut that was not planned from a profile).
    compute_s: float | None = None       # per micro-batch
    link_s: float | None = None          # outgoing transfer per micro-batch, with its codec
    link_uncompressed_s: float | None = None  # the same without compression
    latency_s: float | None = None       # of the outgoing link
    memory_bytes: float | None = None
    capacity_bytes: float | None = None
    pipeline: int = 0
    window: int = 0  # 1F1B: micro-batches in flight when the planner deepened it; 0: the schedule's own
    # The parts of compute_s the step was simulated with, per micro-batch (None where not priced): the
    # predicted trace draws these, so a zero-bubble stage's I and W are the ones its step was priced by
    forward_s: float | None = None
    backward_s: float | None = None
    input_grad_s: float | None = None   # 0 and 0: the node measured no split; the backward is halved
    weight_grad_s: float | None = None
    # Several stages per node: "timed" where the node's actions run in the order built at these
    # stages' costs (launcher/planning/device_plans.py device_lists); "": the schedule's own order.
    device_order: str = ""

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def forward_backward_s(self) -> tuple[float, float]:
        """The forward and backward per micro-batch the step was simulated with (a plan from before
        they were kept: a third and two thirds of compute_s). Only for a priced stage."""
        if self.forward_s is not None and self.backward_s is not None:
            return self.forward_s, self.backward_s
        return self.compute_s / 3, 2 * self.compute_s / 3

    def split_s(self) -> tuple[float, float] | None:
        """The I and W the step was simulated with; None where the node measured no split."""
        if (self.input_grad_s or 0.0) + (self.weight_grad_s or 0.0) > 0:
            return self.input_grad_s, self.weight_grad_s
        return None


@dataclass(frozen=True)
class SyncPlan:
    """One sync group: the nodes (one per pipeline) that sum these layers' gradients."""

    layer_start: int
    layer_end: int
    nodes: tuple[str, ...]
    codec: str = "none"
    allreduce_s: float | None = None  # predicted, when planned from a profile
    exposed_s: float | None = None    # the part that lengthens the step
    hierarchical: bool = False        # summed inside each region first (runtime/hierarchical_sync.py)



def concrete_schedule(name: str) -> str:
    """`auto` where nothing was priced to choose by (a pinned plan without a profile): 1F1B."""
    return AUTO_SCHEDULES[0] if name == AUTO_SCHEDULE else name

@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]  # pipeline 0's stages in order, then pipeline 1's, ...
    num_layers: int
    micro_batch_size: int
    num_microbatches: int          # per step, over all pipelines
    schedule: str
    source: str  # how the cut was chosen: "pinned", "even", "planned"
    predicted_step_s: float | None = None
    predicted_tokens_per_s: float | None = None
    bottleneck: str | None = None
    excluded: dict[str, str] | None = None  # node -> why the plan leaves it out
    pipeline_microbatches: tuple[int, ...] = ()  # each pipeline's share; () means one pipeline takes all
    sync: tuple[SyncPlan, ...] = ()
    batch_note: str = ""  # with a global batch: how the planner chose the micro-batches
    contention_note: str = ""  # nodes that share a host's cores, and what that costs them (priced)
    # The codecs its boundaries and syncs were allowed: what pricing or re-cutting it again allows.
    compression: CompressionConfig = field(default_factory=lambda: NONE, hash=False)
    # Islands (launcher/planning/islands.py): each pipeline's island; () is one island (synchronous).
    islands: tuple[int, ...] = ()
    outer: OuterPlan | None = None  # the outer steps between islands; set exactly when `islands` is
    schedule_choice: str = ""  # schedule: auto — what each candidate schedule was priced at

    def __post_init__(self):
        if not self.pipeline_microbatches:
            object.__setattr__(self, "pipeline_microbatches", (self.num_microbatches,))
        if [s.pipeline for s in self.stages] != sorted(s.pipeline for s in self.stages):
            raise ValueError("plan stages must be listed pipeline after pipeline")
        pipelines = self.pipelines()
        if len(pipelines) != len(self.pipeline_microbatches):
            raise ValueError(f"{len(pipelines)} pipelines but {len(self.pipeline_microbatches)} micro-batch shares")
        if sum(self.pipeline_microbatches) != self.num_microbatches or min(self.pipeline_microbatches) < 1:
            raise ValueError(f"micro-batch shares {list(self.pipeline_microbatches)} must be >= 1 each and sum to "
                             f"{self.num_microbatches}")
        for p, stages in enumerate(pipelines):
            expected = 0
            for stage in stages:
                if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
                    raise ValueError(f"plan stages must tile [0, {self.num_layers}) in order; "
                                     f"stage on {stage.node} has [{stage.layer_start}, {stage.layer_end})")
                expected = stage.layer_end
            if expected != self.num_layers:
                raise ValueError(f"pipeline {p} covers [0, {expected}) of {self.num_layers} layers")
        if (self.outer is None) != (not self.islands):
            raise ValueError("a plan has outer steps exactly when it has islands")
        if self.islands and (len(self.islands) != len(pipelines) or
                             sorted(set(self.islands)) != list(range(max(self.islands) + 1)) or max(self.islands) < 1):
            raise ValueError(f"islands {list(self.islands)} must name an island 0, 1, ... (at least two) "
                             f"for each of the {len(pipelines)} pipelines")

    def pipelines(self) -> list[tuple[StagePlan, ...]]:
        """The stages of each pipeline, in order (pipeline indices are 0, 1, ... with no gap)."""
        count = max(s.pipeline for s in self.stages) + 1
        pipelines = [tuple(s for s in self.stages if s.pipeline == p) for p in range(count)]
        if any(not stages for stages in pipelines):
            raise ValueError("pipeline indices must run 0, 1, ... without a gap")
        return pipelines

    def island_members(self) -> list[list[int]]:
        """The pipeline indices of each island, in island order (one island without islands)."""
        count = len(self.pipeline_microbatches)
        if not self.islands:
            return [list(range(count))]
        return [[p for p in range(count) if self.islands[p] == i] for i in range(max(self.islands) + 1)]

    def island_microbatches(self) -> list[int]:
        """Each island's micro-batches per step."""
        return [sum(self.pipeline_microbatches[p] for p in members) for members in self.island_members()]

    def sync_plans(self) -> tuple[SyncPlan, ...]:
        """The plan's every-step sync groups (inside each island): as planned, else derived from
        the cuts (codec none)."""
        if self.sync or len(self.pipeline_microbatches) == 1:
            return self.sync
        pipelines = self.pipelines()
        return tuple(plan for members in self.island_members()
                     for plan in _derived_sync([pipelines[p] for p in members]))

    def outer_sync_plans(self) -> tuple[SyncPlan, ...]:
        """The outer exchange's groups: per layer range, its holders in every pipeline of every island."""
        if self.outer is None:
            return ()
        return tuple(replace(g, codec=self.outer.codec) for g in _derived_sync(self.pipelines()))

    def to_dict(self) -> dict:
        return {**asdict(self), "compression": self.compression.model_dump()}


def _derived_sync(pipelines: list[tuple[StagePlan, ...]]) -> list[SyncPlan]:
    return [SyncPlan(g.layer_start, g.layer_end, tuple(pipelines[p][j].node for p, j in g.holders))
            for g in sync_groups([[(s.layer_start, s.layer_end) for s in stages] for stages in pipelines])]


class TilingError(ValueError):
    """Pinned layer ranges that do not tile the model: one line naming the first problem."""


def check_layer_tiling(ranges: list[tuple[str, int, int]], num_layers: int) -> None:
    """Check that ``(label, start, end)`` ranges tile ``[0, num_layers)`` exactly.

    ``label`` names the owner in messages (``"nodes[1].layers"``, or a node name).
    Raises TilingError naming the first problem: start >= end, out of range,
    overlap, or a gap. Used by the YAML validator and for pinned plans."""
    for label, start, end in ranges:
        if not start < end:
            raise TilingError(f"{label}: start must be < end (got [{start}, {end}))")
        if start < 0 or end > num_layers:
            raise TilingError(f"{label}: [{start}, {end}) is out of range; the model has layers [0, {num_layers})")
    covered, prev = 0, None
    for label, start, end in sorted(ranges, key=lambda r: (r[1], r[2])):
        if start < covered:
            raise TilingError(f"{label}: [{start}, {end}) overlaps {prev[0]} [{prev[1]}, {prev[2]})")
        if start > covered:
            raise TilingError(f"layers leave [{covered}, {start}) unassigned")
        covered, prev = end, (label, start, end)
    if covered < num_layers:
        raise TilingError(f"layers leave [{covered}, {num_layers}) unassigned")


def even_split(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges as equal as possible; the first stages take the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def even_shares(total: int, parts: int) -> list[int]:
    """Micro-batches per pipeline when nothing was measured: as equal as possible."""
    return [hi - lo for lo, hi in even_split(total, parts)]


def check_windows(stages: list[StagePlan], num_microbatches: int) -> None:
    """TilingError unless each pinned 1F1B window is at least the schedule's own (S - j) and at
    most the micro-batches, and windows never grow down the pipeline."""
    S, above = len(stages), None
    for j, stage in enumerate(stages):
        own = own_window(j, S, num_microbatches)
        window = stage.window or own
        if stage.window and not own <= stage.window <= num_microbatches:
            raise TilingError(f"{stage.node}: window {stage.window} must be from {own} "
                              f"(1F1B's own at stage {j} of {S}) to the {num_microbatches} micro-batches of its pipeline")
        if above is not None and window > above:
            raise TilingError(f"{stage.node}: window {window} is deeper than the stage before it ({above}); "
                              f"windows must not grow down the pipeline")
        above = window


def pinned_num_layers(cluster) -> int:
    """The layers pinned `layers:` ranges must tile: the built-in GPT's count, else the end of the
    last range (an entrypoint's depth is known only to the agents that build it; the agent of a
    pipeline's last stage refuses a range that does not end at the model's last layer)."""
    known = cluster.model.num_stage_layers
    return known if known is not None else max(n.layers[1] for n in cluster.nodes)


def static_plan(cluster, num_layers: int) -> Plan:
    """The plan from the YAML alone: pinned `layers:` ranges (one pipeline per `pipeline:` index),
    else an even split in node order."""
    train = cluster.train
    if cluster.pinned:
        chains = []
        for members in cluster.pinned_pipelines():
            check_layer_tiling([(n.name, n.layers[0], n.layers[1]) for _, n in members], num_layers)
            chains.append([(n, tuple(n.layers)) for _, n in sorted(members, key=lambda m: m[1].layers[0])])
        source = "pinned"
    else:
        nodes = list(cluster.nodes)
        chains, source = [list(zip(nodes, even_split(num_layers, len(nodes))))], "even"
    # Without a profile `auto` has nothing to decide from: only pinned codecs apply.
    policy = cluster.compression
    stages = []
    for p, chain in enumerate(chains):
        for j, (node, (start, end)) in enumerate(chain):
            codec = "none"
            if j < len(chain) - 1:
                allowed = policy.candidates(j, node.region == chain[j + 1][0].region)
                codec = allowed[0] if len(allowed) == 1 else "none"
            stages.append(StagePlan(node=node.name, region=node.region, layer_start=start, layer_end=end,
                                    forward_codec=codec, backward_codec=policy.gradient_codec(codec), pipeline=p,
                                    window=node.window or 0))
    size, count = train.batch_shape()
    shares = tuple(train.pipeline_microbatches or even_shares(count, len(chains)))
    sync_codec = policy.sync if policy.sync != "auto" else "none"
    plan = Plan(stages=tuple(stages), num_layers=num_layers, micro_batch_size=size,
                num_microbatches=count, schedule=concrete_schedule(train.schedule), source=source,
                pipeline_microbatches=shares, compression=policy)
    for pipeline, share in zip(plan.pipelines(), shares):
        check_windows(list(pipeline), share)
    plan = with_pinned_islands(cluster, plan)
    tiered = policy.sync_topology == "hierarchical"  # auto: nothing priced it, so a flat ring
    return replace(plan, sync=tuple(
        replace(g, codec=sync_codec,
                hierarchical=tiered and hierarchy_applies([cluster.node(n).region for n in g.nodes]))
        for g in plan.sync_plans()))


def with_pinned_islands(cluster, plan: Plan) -> Plan:
    """`plan` with the YAML's islands (train.outer) over its pipelines, H as pinned or the default
    (nothing priced it); unchanged without train.outer or when every pipeline is in one island."""
    outer = cluster.train.outer
    if outer is None:
        return plan
    groups = island_groups(outer.islands, [(n.name, n.region) for n in cluster.nodes])
    islands = pipeline_islands([[s.node for s in stages] for stages in plan.pipelines()], groups)
    if not islands:
        return plan
    every, source = (DEFAULT_EVERY, "default") if outer.every == "auto" else (outer.every, "pinned")
    return replace(plan, islands=islands, outer=outer_plan(outer, every, source))


def outer_plan(outer, every: int, source: str, **priced) -> OuterPlan:
    """The OuterPlan of a YAML's train.outer at `every` inner steps."""
    return OuterPlan(every=every, lr=outer.lr, momentum=outer.momentum, codec=outer.codec,
                     fragments=outer.fragments, delay=min(outer.delay, every - 1), alpha=outer.alpha,
                     every_source=source, **priced)


def planned(cluster, result, source: str = "planned") -> Plan:
    """The plan `up` runs from the planner's result: its pipelines, shares, sync groups and the
    codecs it was allowed."""
    policy = result.compression
    stages = tuple(StagePlan(node=s.node, region=cluster.node(s.node).region, layer_start=s.layer_start,
                             layer_end=s.layer_end, forward_codec=s.codec, backward_codec=policy.gradient_codec(s.codec),
                             compute_s=s.compute_s, link_s=s.link_s, link_uncompressed_s=s.link_uncompressed_s,
                             latency_s=s.latency_s,
                             memory_bytes=s.memory_bytes, capacity_bytes=s.capacity_bytes, pipeline=p,
                             window=cluster.node(s.node).window or s.window,  # a window pinned in the YAML wins
                             forward_s=s.forward_s, backward_s=s.backward_s, input_grad_s=s.input_grad_s,
                             weight_grad_s=s.weight_grad_s, device_order=pipeline.cost.device_order)
                   for p, pipeline in enumerate(result.pipelines) for s in pipeline.cost.stages)
    sync = tuple(SyncPlan(g.layer_start, g.layer_end, tuple(g.nodes), g.codec, g.allreduce_s, g.exposed_s,
                          g.hierarchical)
                 for g in result.sync)
    slowest = max(result.pipelines, key=lambda p: p.cost.step_s).cost
    bottleneck = slowest.bottleneck
    if sync and max(g.exposed_s for g in sync) > 0:
        worst = max(sync, key=lambda g: g.exposed_s)
        bottleneck = f"gradient sync of layers {worst.layer_start}–{worst.layer_end - 1} over {', '.join(worst.nodes)}"
    train = cluster.train
    return Plan(stages=stages, num_layers=stages[-1].layer_end, micro_batch_size=result.micro_batch_size,
                num_microbatches=sum(p.cost.num_microbatches for p in result.pipelines),
                schedule=result.schedule or concrete_schedule(train.schedule), schedule_choice=result.schedule_choice,
                source=source,
                predicted_step_s=result.step_s, predicted_tokens_per_s=result.tokens_per_s,
                bottleneck=bottleneck, excluded=dict(result.excluded),
                pipeline_microbatches=tuple(p.cost.num_microbatches for p in result.pipelines), sync=sync,
                batch_note=describe(result.batch) if result.batch else "",
                contention_note="; ".join(f"nodes on host {host} share its cores: their compute priced {factor:.2f}x "
                                          f"slower than profiled"
                                          for host, factor in sorted(result.contention.items())),
                compression=policy)
