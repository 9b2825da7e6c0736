"""Plan a job of islands: each island planned as today's job on its own nodes, then merged.

1. Group the profile's nodes into islands (train.outer.islands: by region, or the YAML's lists).
2. Plan each island alone (at the step's micro-batches, at most SPEED_PROBE); its predicted
   tokens/s is its speed.
   An island that cannot hold the model is left out (its nodes in `excluded`, with the reason).
3. Share the step's micro-batches between the islands in proportion to their speeds, so islands
   that start an outer period together end it together, and plan each island again at its share.
4. Merge: pipelines island after island; each island's gradient sync stays inside it. Price the
   outer exchange (launcher/planning/islands.py) on the profile's links between the islands'
   representatives of each layer range (runtime/outer_sync.py), choose H where `every: auto`, and predict the step with the exchange's
   exposed part spread over H steps.

The merged plan's step is the slowest island's plus the exposed exchange / H; islands do not
wait for each other between outer steps, but the shares make them take equally long.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hetlaunch.launcher.planning.batch_sizes import at_size
from hetlaunch.launcher.planning.islands import (ExchangeGroup, OuterPlan, choose_every, exchange_seconds,
                                                 exposed_seconds, island_groups)
from hetlaunch.launcher.planning.plan import Plan, outer_plan, planned
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.profile_edits import subset
from hetlaunch.launcher.planning.profile_file import Profile
from hetlaunch.launcher.planning.replicas import split_microbatches
from hetlaunch.runtime.registry import AUTO_SCHEDULE, AUTO_SCHEDULES, codec_info
from hetlaunch.launcher.planning.request import PlanRequest, plan_for


SPEED_PROBE = 64


def plan_islands(cluster, profile: Profile, request: PlanRequest, source: str = "planned") -> Plan:
    """The plan for `profile`'s nodes under cluster.train.outer (a plain plan when they form one island)."""
    outer = cluster.train.outer
    too_many = outer.too_many_fragments(profile.model.num_layers)  # a model of its own entrypoint: sized here
    if too_many:
        raise PlanningError(f"train.outer.fragments: {too_many}")
    if request.schedule == AUTO_SCHEDULE:  # one schedule for every island's pipelines: 1F1B's for now
        request = replace(request, schedule=AUTO_SCHEDULES[0])
    groups = island_groups(outer.islands, [(n.name, n.region) for n in profile.nodes])
    listed = {name for group in groups for name in group}
    unlisted = {n.name: "in no island of train.outer.islands" for n in profile.nodes if n.name not in listed}
    profile = with_outer_memory(subset(profile, sorted(listed)), outer, len(groups))
    if len(groups) < 2:
        plan = planned(cluster, plan_for(profile, request), source=source)
        return replace(plan, excluded={**(plan.excluded or {}), **unlisted})
    if request.global_batch is not None:  # one micro-batch size for every island: the YAML's shape
        size, count = cluster.train.batch_shape()
        profile = at_size(profile, size)
        request = replace(request, num_microbatches=count, global_batch=None, fixed_microbatches=None)
    total = request.num_microbatches
    # Speeds only set the shares: priced at up to SPEED_PROBE micro-batches, where a pipeline's
    # bubble is already small, since simulating a long step costs in proportion to its length.
    probe = replace(request, num_microbatches=min(total, SPEED_PROBE))
    speeds, kept, excluded = [], [], dict(unlisted)
    for names in groups:
        try:
            result = plan_for(subset(profile, names), probe)
        except PlanningError as err:
            excluded.update({n: f"its island ({', '.join(names)}) cannot train the model alone: {err}" for n in names})
            continue
        kept.append(names)
        speeds.append(result.tokens_per_s)
    if not kept:
        raise PlanningError("no island can train the model alone: " + "; ".join(sorted(set(excluded.values()))))
    if len(kept) == 1:
        plan = planned(cluster, plan_for(subset(profile, kept[0]), request), source=source)
        return replace(plan, excluded={**(plan.excluded or {}), **excluded})
    if total < len(kept):
        raise PlanningError(f"{total} micro-batches a step cannot feed {len(kept)} islands (each needs one): "
                            f"raise train.num_microbatches or list fewer islands")
    shares = split_microbatches(total, speeds)  # as pipelines' shares are split
    plans = []
    for names, m in zip(kept, shares):
        try:
            plans.append(planned(cluster, plan_for(subset(profile, names), replace(request, num_microbatches=m)),
                                 source=source))
        except PlanningError as err:  # fits at the probe's size, not at its share
            raise PlanningError(f"island {', '.join(names)} cannot train its share of {m} micro-batches: {err}") from None
    return price_outer(cluster, profile, merge(plans, excluded))


def with_outer_memory(profile: Profile, outer, islands: int) -> Profile:
    """The profile a plan of islands is made on: each parameter byte also holds an anchor and an
    outer momentum (fp32), an error-feedback buffer with a lossy codec, and during an exchange
    the islands' encoded deltas of one fragment (launcher/planning/cost_model.py prices these
    with the parameters, gradients and optimizer state)."""
    lossy = outer.codec != "none"
    gathered = islands * codec_info(outer.codec).wire_ratio() / outer.fragments
    return profile.model_copy(update={"static_extra_per_param_byte": 2 + (1 if lossy else 0) + gathered})


class ProfileCluster:
    """What planning islands reads of a cluster YAML, made from a profile and a train section:
    `hetlaunch plan --profile P --islands` and the benchmarks plan islands with no YAML."""

    def __init__(self, profile: Profile, train):
        self.train = train
        self._nodes = {n.name: n for n in profile.nodes}

    def node(self, name: str):
        return _OfflineNode(self._nodes[name].region)


@dataclass(frozen=True)
class _OfflineNode:
    region: str
    window: int | None = None


def merge(plans: list[Plan], excluded: dict[str, str]) -> Plan:
    """One plan of the islands' plans, pipelines island after island (each island's outer steps unpriced)."""
    stages, shares, islands, sync, offset = [], [], [], [], 0
    for island, plan in enumerate(plans):
        stages += [replace(s, pipeline=s.pipeline + offset) for s in plan.stages]
        shares += plan.pipeline_microbatches
        islands += [island] * len(plan.pipeline_microbatches)
        sync += plan.sync
        offset += len(plan.pipeline_microbatches)
    first = plans[0]
    slowest = max(plans, key=lambda p: p.predicted_step_s or 0.0)
    return replace(first, stages=tuple(stages), num_microbatches=sum(shares), pipeline_microbatches=tuple(shares),
                   sync=tuple(sync), islands=tuple(islands), predicted_step_s=slowest.predicted_step_s,
                   bottleneck=slowest.bottleneck,
                   excluded={**{k: v for p in plans for k, v in (p.excluded or {}).items()}, **excluded},
                   contention_note="; ".join(p.contention_note for p in plans if p.contention_note),
                   outer=OuterPlan(every=1))  # a plan with islands carries one: price_outer sets the real one


def price_outer(cluster, profile: Profile, plan: Plan, every: int | None = None) -> Plan:
    """`plan` (with islands) with its outer steps priced on `profile`: the exchange, H where it is
    auto (capped at train.steps: an outer step must happen; `every` given: that one, e.g. the
    running plan's), the step and tokens/s with the exposed exchange spread over H steps."""
    outer = cluster.train.outer
    codec = outer.codec
    groups = []
    first_pipeline = [members[0] for members in plan.island_members()]
    for g in replace(plan, outer=replace(plan.outer, codec=codec)).outer_sync_plans():
        # Each island's representative (its first pipeline's holder) crosses; the average then
        # reaches the island's other holders inside the island (not priced: in-region links).
        nodes = [profile.node(g.nodes[p]) for p in first_pipeline]
        links = [profile.link(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
        groups.append(ExchangeGroup(sum(profile.layers[i].param_bytes for i in range(g.layer_start, g.layer_end)),
                                    tuple(n.name for n in nodes), min(link.bandwidth_bytes_per_s for link in links),
                                    max(link.latency_s for link in links)))
    exchange_s, wire_bytes = exchange_seconds(groups, codec)
    step_s = plan.predicted_step_s or 0.0
    if every is not None:
        source = plan.outer.every_source
    elif outer.every == "auto":
        chosen = choose_every(exchange_s, step_s, outer.fragments, outer.delay)
        every, source = (chosen, "planned") if chosen <= cluster.train.steps else (cluster.train.steps, "capped")
    else:
        every, source = outer.every, "pinned"
    o = outer_plan(outer, every, source, exchange_s=exchange_s, wire_bytes=wire_bytes)
    o = replace(o, exposed_s=exposed_seconds(exchange_s, step_s, o.fragments, o.delay))
    step = step_s + o.exposed_s / every
    tokens = plan.num_microbatches * plan.micro_batch_size * profile.seq_len
    bottleneck = plan.bottleneck
    if o.exposed_s / every > 0.5 * step_s:
        bottleneck = f"the outer exchange between islands ({exchange_s:.3g} s every {every} steps)"
    return replace(plan, outer=o, predicted_step_s=step, predicted_tokens_per_s=tokens / step if step > 0 else None,
                   bottleneck=bottleneck)
