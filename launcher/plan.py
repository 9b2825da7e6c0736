"""A plan: which node runs which contiguous layer range, in which order, with which codecs.

A plan is plain data so that it can be produced anywhere: from pinned `layers:` in the
YAML, by an even split (this file), or later by the measured planner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    memory_bytes: float | None = None
    capacity_bytes: float | None = None

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    num_layers: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    source: str  # how the cut was chosen: "pinned", "even", "planned"
    generation: int = 0
    predicted_step_s: float | None = None
    predicted_tokens_per_s: float | None = None
    bottleneck: str | None = None
    excluded: dict[str, str] | None = None  # node -> why the plan leaves it out

    def __post_init__(self):
        expected = 0
        for stage in self.stages:
            if stage.layer_start != expected or stage.layer_end <= stage.layer_start:
                raise ValueError(f"plan stages must tile [0, {self.num_layers}) in order; "
                                 f"stage on {stage.node} has [{stage.layer_start}, {stage.layer_end})")
            expected = stage.layer_end
        if expected != self.num_layers:
            raise ValueError(f"plan covers [0, {expected}) of {self.num_layers} layers")

    def to_dict(self) -> dict:
        return asdict(self)


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


def static_plan(cluster, num_layers: int) -> Plan:
    """The plan from the YAML alone: pinned `layers:` ranges, else an even split in node order."""
    from hetlaunch.launcher.cluster_config import check_layer_tiling

    train = cluster.train
    nodes = list(cluster.nodes)
    if all(n.layers is not None for n in nodes):
        check_layer_tiling([(n.name, n.layers[0], n.layers[1]) for n in nodes], num_layers)
        nodes.sort(key=lambda n: n.layers[0])
        ranges, source = [tuple(n.layers) for n in nodes], "pinned"
    else:
        ranges, source = even_split(num_layers, len(nodes)), "even"
    # Without a profile `auto` has nothing to decide from: only pinned codecs apply.
    policy = cluster.compression
    codecs = []
    for j, (a, b) in enumerate(zip(nodes, nodes[1:])):
        allowed = policy.candidates(j, a.region == b.region)
        codecs.append(allowed[0] if len(allowed) == 1 else "none")
    codecs.append("none")
    stages = tuple(StagePlan(node=n.name, region=n.region, layer_start=s, layer_end=e, forward_codec=codec,
                             backward_codec=policy.gradient_codec(codec))
                   for n, (s, e), codec in zip(nodes, ranges, codecs))
    return Plan(stages=stages, num_layers=num_layers, micro_batch_size=train.micro_batch_size,
                num_microbatches=train.num_microbatches, schedule=train.schedule, source=source)


def planned(cluster, result) -> Plan:
    """The plan `up` runs from the planner's single best pipeline."""
    from hetlaunch.launcher.planner import PlannerResult

    assert isinstance(result, PlannerResult) and len(result.pipelines) == 1
    cost = result.pipelines[0].cost
    policy = cluster.compression
    stages = tuple(StagePlan(node=s.node, region=cluster.node(s.node).region, layer_start=s.layer_start,
                             layer_end=s.layer_end, forward_codec=s.codec, backward_codec=policy.gradient_codec(s.codec),
                             compute_s=s.compute_s, link_s=s.link_s, link_uncompressed_s=s.link_uncompressed_s,
                             memory_bytes=s.memory_bytes, capacity_bytes=s.capacity_bytes) for s in cost.stages)
    train = cluster.train
    return Plan(stages=stages, num_layers=stages[-1].layer_end, micro_batch_size=train.micro_batch_size,
                num_microbatches=train.num_microbatches, schedule=train.schedule, source="planned",
                predicted_step_s=result.step_s, predicted_tokens_per_s=result.tokens_per_s,
                bottleneck=cost.bottleneck, excluded=dict(result.excluded))
