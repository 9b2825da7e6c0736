"""A plan's topology: which data-plane rank runs which stage of which pipeline on which node, and
which stages hold each layer.

One object answers what the launcher used to rebuild by hand from `plan.stages` in each module
(node -> rank, node -> layer range, node -> (pipeline, stage), layer -> holders, the checkpoint
writers). Ranks follow `plan.stages`, pipeline after pipeline, as the data plane numbers them.

A node may hold several stages (a V-shaped or interleaved layout gives a node two stages of one
pipeline; a node may also serve two pipelines). What is keyed by placement takes such plans as
they are: the layer holders, the checkpoint writers (one per stage), the nodes a plan uses.

The planner makes such plans for the several-stages-per-node schedules (interleaved-1f1b, zb-v;
one pipeline or several, each node in one, launcher/planning/device_plans.py). The control plane addresses a node, not a stage:
a node's agent runs one stage worker per generation, which is one data-plane rank, so under those
schedules a placement's `rank` (one per stage) is not the data plane's: the node's worker is rank
`device_rank` (its position in the pipeline), and launcher/device_stage_launch.py sends it all its
stages in one command. Following the generation and joining its step reports ask `node_workers`,
which answers a node's one worker for those schedules; a checkpoint part tells the node's stages
apart by its first layer (checkpoint_book).

What is keyed by node otherwise asks `by_node(feature)` (or `only_stage`), which refuses a node
holding several stages with one line naming the feature: launching a one-stage-per-node
generation (stage_launch), trace.json's tracks (timeline), calibration and the straggler watch,
live moves. The YAML refuses or turns off those features for the several-stages schedules
(launcher/device_schedule_checks.py), so they never meet such a plan.

Torch-free and in `planning/`: the planner asks it which nodes a plan uses, and planning imports
only itself (tests/test_import_rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from hetlaunch.runtime.registry import DEVICE_SCHEDULE_NAMES

if TYPE_CHECKING:
    from hetlaunch.launcher.planning.plan import Plan


class SeveralStagesError(ValueError):
    """A feature keyed by node met a node that holds several stages."""


@dataclass(frozen=True)
class Placement:
    """One data-plane rank: stage `stage` of pipeline `pipeline`, on `node`, holding
    layers [layer_start, layer_end)."""

    rank: int
    node: str
    pipeline: int
    stage: int  # index within its pipeline
    layer_start: int
    layer_end: int
    # What it was made from (a StagePlan: codecs, window, region, predictions; or a planner's
    # StageCost): callers that build commands need it, equality does not.
    source: Any = field(default=None, compare=False, repr=False)

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    def holds(self, layer: int) -> bool:
        return self.layer_start <= layer < self.layer_end


def one_per_node(placements: Iterable[Placement], feature: str) -> dict[str, Placement]:
    """node -> its only placement among `placements` (in their order); SeveralStagesError naming
    `feature` when a node holds more than one."""
    out: dict[str, Placement] = {}
    counts: dict[str, int] = {}
    for placement in placements:
        counts[placement.node] = counts.get(placement.node, 0) + 1
        out.setdefault(placement.node, placement)
    for node, count in counts.items():
        if count > 1:
            raise SeveralStagesError(f"node {node} holds {count} stages; {feature} supports one stage per node")
    return out


@dataclass(frozen=True)
class Topology:
    placements: tuple[Placement, ...]  # in rank order
    pipelines: tuple[tuple[Placement, ...], ...] = field(init=False, repr=False)
    nodes: tuple[str, ...] = field(init=False, repr=False)  # each once, in rank order
    num_layers: int = field(init=False, repr=False)
    _by_node: dict[str, tuple[Placement, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.placements:
            raise ValueError("a topology needs at least one stage")
        if [q.rank for q in self.placements] != list(range(len(self.placements))):
            raise ValueError("placements must be listed in rank order, ranks 0, 1, ...")
        count = self.placements[-1].pipeline + 1
        pipelines = tuple(tuple(q for q in self.placements if q.pipeline == p) for p in range(count))
        if [q.pipeline for q in self.placements] != sorted(q.pipeline for q in self.placements) or not all(pipelines):
            raise ValueError("placements must run pipeline after pipeline, pipelines 0, 1, ... without a gap")
        num_layers = pipelines[0][-1].layer_end
        for p, stages in enumerate(pipelines):
            reached = 0
            for j, q in enumerate(stages):
                if q.stage != j or q.layer_start != reached or q.layer_end <= q.layer_start:
                    raise ValueError(f"pipeline {p}: stage {j} on {q.node} holds [{q.layer_start}, {q.layer_end}); "
                                     f"stages must tile the layers in order from 0")
                reached = q.layer_end
            if reached != num_layers:
                raise ValueError(f"pipeline {p} covers [0, {reached}), pipeline 0 [0, {num_layers})")
        by_node: dict[str, tuple[Placement, ...]] = {}
        for q in self.placements:
            by_node[q.node] = by_node.get(q.node, ()) + (q,)
        object.__setattr__(self, "pipelines", pipelines)
        object.__setattr__(self, "nodes", tuple(by_node))
        object.__setattr__(self, "num_layers", num_layers)
        object.__setattr__(self, "_by_node", by_node)

    @classmethod
    def of(cls, plan: Plan) -> Topology:
        """The topology of a plan (its `stages` are listed pipeline after pipeline: rank order)."""
        return cls.of_pipelines(plan.pipelines())

    @classmethod
    def of_pipelines(cls, pipelines: Iterable[Sequence[Any]]) -> Topology:
        """From each pipeline's stages in order: anything with `node`, `layer_start`, `layer_end`
        (a plan's StagePlans, a planner's StageCosts)."""
        placements, rank = [], 0
        for p, stages in enumerate(pipelines):
            for j, s in enumerate(stages):
                placements.append(Placement(rank, s.node, p, j, s.layer_start, s.layer_end, s))
                rank += 1
        return cls(tuple(placements))

    def stages_of(self, node: str) -> tuple[Placement, ...]:
        """The node's placements in rank order; () for a node the plan does not use."""
        return self._by_node.get(node, ())

    def placement(self, node: str, *, stage: int | None = None, pipeline: int | None = None) -> Placement:
        """The one placement on `node` (of stage index `stage`, in `pipeline`, where given)."""
        found = [q for q in self.stages_of(node)
                 if (stage is None or q.stage == stage) and (pipeline is None or q.pipeline == pipeline)]
        if len(found) != 1:
            which = "".join(f" {k} {v}" for k, v in (("stage", stage), ("pipeline", pipeline)) if v is not None)
            raise ValueError(f"node {node} holds {len(found)} stages matching{which or ' anything'}; "
                             f"name the stage index or pipeline of one")
        return found[0]

    def rank_of(self, node: str, *, stage: int | None = None, pipeline: int | None = None) -> int:
        return self.placement(node, stage=stage, pipeline=pipeline).rank

    def holders(self, layer: int) -> tuple[Placement, ...]:
        """The placements holding `layer`: one per pipeline, in pipeline order."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is out of range; the model has layers [0, {self.num_layers})")
        return tuple(next(q for q in stages if q.holds(layer)) for stages in self.pipelines)

    def holder(self, node: str, layer: int) -> Placement:
        """The placement on `node` that holds `layer` (a sync group names nodes and layers)."""
        found = [q for q in self.holders(layer) if q.node == node]
        if len(found) != 1:
            raise ValueError(f"node {node} holds layer {layer} in {len(found)} pipelines; expected exactly one")
        return found[0]

    def checkpoint_writers(self) -> dict[tuple[str, int], Placement]:
        """(node, stage index) -> placement, for the stages whose parts make a checkpoint:
        pipeline 0's, which together hold every layer once. A node with two stages writes two."""
        return {(q.node, q.stage): q for q in self.pipelines[0]}

    def by_node(self, feature: str) -> dict[str, Placement]:
        """node -> its stage, in rank order, for a feature keyed by node; SeveralStagesError
        ("node X holds 2 stages; <feature> supports one stage per node") otherwise."""
        return one_per_node(self.placements, feature)

    def only_stage(self, node: str, feature: str) -> Placement:
        """The node's one stage, refused as in `by_node`; KeyError for a node the plan does not use."""
        stages = self._by_node[node]
        return one_per_node(stages, feature)[node]


def node_workers(plan: Plan, feature: str) -> dict[str, Placement]:
    """node -> the placement its one stage worker reports as, for a feature keyed by node.

    Under a several-stages-per-node schedule (interleaved-1f1b, zb-v) a node's one worker runs all
    its stages, of one pipeline, and reports once per step, as its first stage, which is its
    position in its pipeline (both placements put stage d on device d): a report names the node,
    and two stages of one node never come as two reports. Otherwise `Topology.by_node(feature)`."""
    topology = Topology.of(plan)
    if plan.schedule not in DEVICE_SCHEDULE_NAMES:
        return topology.by_node(feature)
    workers = {node: topology.stages_of(node)[0] for node in topology.nodes}
    for node, first in workers.items():
        if any(q.pipeline != first.pipeline for q in topology.stages_of(node)):
            raise SeveralStagesError(f"node {node} holds stages of several pipelines; {plan.schedule} runs a "
                                     f"node in one, which {feature} needs")
    return workers


def device_rank(plan: Plan, node: str) -> int:
    """The data-plane rank of `node`'s worker under a several-stages-per-node schedule: the order
    the nodes first appear in, pipeline after pipeline, so a pipeline's nodes are consecutive ranks
    in the order of its devices (stage d being on device d)."""
    return Topology.of(plan).nodes.index(node)
