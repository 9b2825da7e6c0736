"""The cost of gradient synchronisation between data-parallel pipelines, and its codec choice.

Several pipelines train one model; the stages that hold a layer (one per pipeline) sum its
gradients before any optimizer steps. launcher/planning/sync_groups.py cuts the layers into sync
groups, maximal layer runs with one holder set. For a group G of layers [g0, g1) held by
k nodes, with every quantity from the profile:

    bytes = sum_{l in G} param_bytes[l]          (fp32 gradients, the size of the parameters)
    bw    = min over holder pairs of bandwidth(a, b)     (the slowest link paces a ring)
    lat   = max over holder pairs of latency(a, b)

    codec none (ring all-reduce):  A = 2 (k-1)/k * bytes / bw  +  2 (k-1) * lat
    codec c (what the runtime does: every holder all-gathers the others' encoded gradients,
    then decodes and sums them in the same order, with error feedback):
                                   A = (k-1) * bytes * wire_ratio(c) / bw  +  (k-1) * lat
                                       + bytes * codec_seconds_per_byte[c] of the slowest holder
    (the codec term counts one encode + decode; decoding the k-1 payloads is taken as
    overlapping with their arrival. A group without parameters has nothing to sync: A = 0.)
    sealed (data_plane.encrypt covers the holders; runtime/sealed_exchange.py: ciphertext cannot
    be summed, so every holder sends each other one its sealed copy, whatever the codec):
                                   A = (k-1) * (w / bw + lat + w * cipher_seconds_per_byte)
                                       + the codec term,  w = bytes * wire_ratio(c)

Hierarchical (runtime/hierarchical_sync.py), for holders in r >= 2 regions, some region with
m >= 2 of them: the regions sum inside (a ring over the region's slowest link), their first
holders (leaders) exchange the sums as above with k = r over the leaders' slowest link, and each
leader sends the total to the other m - 1 holders of its region (gloo's broadcast: one to all):

    A_h = max_R ring(bytes, m_R, region R's link)  +  A(bytes, r, leaders' link, codec)
          + max_R ((m_R - 1) * bytes / bw_R + lat_R)

One copy per region crosses a slow link, and the slow hops are 2(r-1) instead of 2(k-1).
`compression.sync_topology`: auto (default) prices both and keeps the faster per group; ring
or hierarchical pins one (hierarchical only where it applies).

Overlap. A stage's gradients become final during its last backward of the step, and the
runtime (runtime/grad_sync.py) buckets them like DDP — at most SYNC_BUCKET_BYTES per
bucket, a bucket never spans two groups — and starts a bucket's reduction as soon as its
gradients are final. For holder (pipeline p, stage j), with pipeline p's step time step_p
(launcher/planning/cost_model.py, at its own share of the micro-batches) and its stages' t, lat, c:

    drain_j = sum_{k<j} (2/3 t_k + lat_k + c_k)   after stage j's last backward, the last
                                                  gradient still travels up to stage 0
    end_pj  = step_p - drain_j                    stage j finishes its last backward
    ready   = end_pj - 2/3 * compute(layers [stage start, g0) on that node)
              (compute as CostModel.compute_s: per micro-batch, optimizer spread over p's share)
              (backward runs from the stage's last layer down, so G is final before the
              layers below it are done)
    ready_G = max over holders of ready           (the reduction needs every holder)
    bwd_G   = 2/3 * compute(G) on its slowest holder
    n       = ceil(bytes / SYNC_BUCKET_BYTES)
    end_G   = max(ready_G + A / n,  ready_G - bwd_G + A)
              (the buckets stream during G's own backward: at best only the last bucket is
              left when G is final, at worst the reduction itself is the bottleneck)

    plan step = max(max_p step_p, max_G end_G);   exposed_G = max(0, end_G - max_p step_p)

Groups without a node in common reduce in parallel. Groups that share a node (a stage
whose layers the other pipelines cut differently holds several) share its link: taken in
the order they become ready, each node's link carries its groups one after another, and a
group ends when the busiest of its holders' links has carried it (a queue per node).

Codec choice (`compression.sync`): per group, the least lossy allowed codec whose plan step
stays within CODEC_SLACK of the step with every group at its fastest codec, so a group is
compressed only when its sync is on the critical path. `auto` allows none, fp16 and int8
for groups whose holders span regions and only none inside a region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

from hetlaunch.launcher.planning.compression import CODEC_SLACK, LOSSINESS, NONE, CompressionConfig
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.sync_groups import SyncGroup, hierarchy_applies, sync_groups
from hetlaunch.runtime.registry import SYNC_BUCKET_BYTES, codec_info, must_seal, sync_hops

BACKWARD_SHARE = 2 / 3  # profiles hold forward + backward; backward is taken as twice forward


@dataclass(frozen=True)
class SyncCost:
    layer_start: int  # [layer_start, layer_end)
    layer_end: int
    nodes: tuple[str, ...]  # one holder per pipeline, in pipeline order
    bytes: int  # gradient bytes each holder contributes
    codec: str
    bandwidth_bytes_per_s: float  # slowest link among the holders
    latency_s: float  # largest latency among the holders
    allreduce_s: float  # A: the reduction alone
    end_s: float  # end_G: when the group's gradients are summed, from the step's start
    exposed_s: float  # how much of it lies past the slowest pipeline's step
    hierarchical: bool = False  # summed inside each region, exchanged between regions, broadcast back


@dataclass(frozen=True)
class _Group:
    """What a group's cost needs besides the codec."""
    group: SyncGroup
    nodes: tuple[NodeProfile, ...]
    bytes: int
    bandwidth: float
    latency: float
    cross_region: bool
    ready: float
    backward: float
    tiers: tuple[float, float, float, float] | None = None  # hierarchical: (intra-region s, leaders' bw, lat, r)
    sealed: bool = False  # data_plane.encrypt covers the holders: a sealed all-gather, never hierarchical


def allreduce_s(num_bytes: float, holders: int, bandwidth: float, latency: float, codec: str,
                codec_seconds_per_byte: float = 0.0) -> float:
    """A: one group's reduction, as in the module docstring."""
    if num_bytes <= 0 or holders < 2:
        return 0.0
    hops = sync_hops(codec, holders) * latency
    if codec == "none":  # reduce-scatter then all-gather: each moves (k - 1)/k of the bytes
        return 2 * (holders - 1) / holders * num_bytes / bandwidth + hops
    return (holders - 1) * num_bytes * _ratio(codec) / bandwidth + hops + num_bytes * codec_seconds_per_byte


def sealed_gather_s(num_bytes: float, holders: int, bandwidth: float, latency: float, codec: str,
                    codec_seconds_per_byte: float, cipher_seconds_per_byte: float) -> float:
    """A sealed group's reduction (runtime/sealed_exchange.py): every holder sends each other one
    its sealed (encoded) gradient and adds the copies, so (k - 1) copies cross and each is sealed
    once and opened once; the encode and decode count once, as in allreduce_s's codec form."""
    if num_bytes <= 0 or holders < 2:
        return 0.0
    wire = num_bytes * _ratio(codec)
    codec_s = num_bytes * codec_seconds_per_byte if codec != "none" else 0.0
    return (holders - 1) * (wire / bandwidth + latency + wire * cipher_seconds_per_byte) + codec_s


def sync_costs(profile: Profile, pipelines: Sequence[PipelineCost],
               compression: CompressionConfig = NONE, ready=None) -> list[SyncCost]:
    """Every sync group's cost, each with its codec chosen by `compression.sync`. [] for one pipeline.
    `ready(group)`, where given, dates when a group's gradients are final on all its holders (a
    schedule whose order the drains above do not describe: several stages per node); its reduction
    then starts there, with no overlap credited."""
    return SyncModel(profile).costs(pipelines, compression, ready)


def plan_step_s(pipelines: Sequence[PipelineCost], sync: Sequence[SyncCost]) -> float:
    """The step of the whole plan: the slowest pipeline, or the last group's sync if later."""
    return max([p.step_s for p in pipelines] + [g.end_s for g in sync])


class SyncModel:
    """Prices the sync of many plans of one profile, remembering per-node prefix sums and links."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.params = [0]
        for layer in profile.layers:
            self.params.append(self.params[-1] + layer.param_bytes)
        self.nodes = {n.name: n for n in profile.nodes}
        self._linked = {name for link in profile.links if link.nodes for name in link.nodes}
        self._time: dict[tuple[str, int], list[float]] = {}
        self._links: dict[frozenset, tuple[float, float]] = {}

    def costs(self, pipelines: Sequence[PipelineCost], compression: CompressionConfig = NONE,
              ready=None) -> list[SyncCost]:
        """sync_costs with this model's memory."""
        if len(pipelines) < 2:
            return []
        groups = sync_groups([[(s.layer_start, s.layer_end) for s in p.stages] for p in pipelines])
        step = max(p.step_s for p in pipelines)
        drains = _drains(pipelines)
        options, readies = [], []
        for group in groups:
            described = self.describe(pipelines, drains, group, compression.sync_topology)
            if ready is not None:  # the caller's date; none of the group's own backward overlaps
                described = replace(described, ready=ready(group), backward=0.0)
            readies.append(described.ready)
            codecs = sorted(compression.sync_candidates(described.cross_region), key=LOSSINESS.index)
            shapes = _shapes(described, compression.sync_topology)
            # Least lossy first; of one codec, the faster shape first.
            options.append(sorted((self.priced(described, codec, step, tiered) for codec in codecs for tiered in shapes),
                                  key=lambda o: (LOSSINESS.index(o.codec), o.end_s)))
        best = max([step] + [min(o.end_s for o in costs) for costs in options])
        limit = best * (1 + CODEC_SLACK)
        # Groups only meet in the max, so each one's least lossy codec under the limit keeps the
        # whole plan under it (judged before the groups' shared links are counted).
        chosen = [next((o for o in costs if o.end_s <= limit), min(costs, key=lambda o: o.end_s)) for costs in options]
        return _sharing_links(chosen, readies, step)

    def describe(self, pipelines: Sequence[PipelineCost], drains: list[list[float]], group: SyncGroup,
                 topology: str = "auto") -> _Group:
        nodes, ready, backward = [], -math.inf, 0.0
        for p, j in group.holders:
            pipeline = pipelines[p]
            stage = pipeline.stages[j]
            node = self.nodes[stage.node]
            M = pipeline.num_microbatches
            below = BACKWARD_SHARE * self._compute(node, stage.layer_start, group.layer_start, M)
            ready = max(ready, pipeline.step_s - drains[p][j] - below)
            backward = max(backward, BACKWARD_SHARE * self._compute(node, group.layer_start, group.layer_end, M))
            nodes.append(node)
        bandwidth, latency = self._slowest_link(nodes)
        num_bytes = self.params[group.layer_end] - self.params[group.layer_start]
        mode = self.profile.data_plane_encrypt
        sealed = mode is not None and must_seal(mode, [n.region for n in nodes])
        tiers = self._tiers(nodes, num_bytes) if topology != "ring" and not sealed else None
        return _Group(group, tuple(nodes), num_bytes, bandwidth, latency, len({n.region for n in nodes}) > 1,
                      ready, backward, tiers, sealed)

    def _tiers(self, nodes: Sequence[NodeProfile], num_bytes: int) -> tuple[float, float, float, float] | None:
        """A hierarchical sync's intra-region seconds (phases 1 and 3) and the leaders' link and
        count; None where it does not apply (one region, or one holder per region)."""
        if not hierarchy_applies([n.region for n in nodes]):
            return None
        regions: dict[str, list[NodeProfile]] = {}
        for n in nodes:
            regions.setdefault(n.region, []).append(n)
        inside = [0.0, 0.0]
        for members in regions.values():
            if len(members) > 1:
                bw, lat = self._slowest_link(members)
                inside[0] = max(inside[0], allreduce_s(num_bytes, len(members), bw, lat, "none"))
                inside[1] = max(inside[1], (len(members) - 1) * num_bytes / bw + lat)
        bw, lat = self._slowest_link([m[0] for m in regions.values()])
        return inside[0] + inside[1], bw, lat, len(regions)

    @staticmethod
    def priced(d: _Group, codec: str, step: float, tiered: bool = False) -> SyncCost:
        cost = max(n.codec_cost(codec) for n in d.nodes) if codec != "none" else 0.0
        if d.sealed:
            cipher = max(n.cipher_seconds_per_byte or 0.0 for n in d.nodes)
            reduce_s = sealed_gather_s(d.bytes, len(d.nodes), d.bandwidth, d.latency, codec, cost, cipher)
        elif tiered:
            inside, bandwidth, latency, regions = d.tiers
            reduce_s = inside + allreduce_s(d.bytes, int(regions), bandwidth, latency, codec, cost)
        else:
            reduce_s = allreduce_s(d.bytes, len(d.nodes), d.bandwidth, d.latency, codec, cost)
        end = _reduction_end(d.ready, d.backward, reduce_s, d.bytes)
        return SyncCost(d.group.layer_start, d.group.layer_end, tuple(n.name for n in d.nodes), d.bytes, codec,
                        d.bandwidth, d.latency, reduce_s, end, max(0.0, end - step), tiered)

    def _compute(self, node: NodeProfile, start: int, end: int, num_microbatches: int) -> float:
        """CostModel.compute_s: per micro-batch, the optimizer spread over the micro-batches."""
        acc = self._time_prefix(node, num_microbatches)
        return acc[end] - acc[start]

    def _time_prefix(self, node: NodeProfile, num_microbatches: int) -> list[float]:
        key = (node.name, num_microbatches)
        acc = self._time.get(key)
        if acc is None:
            acc, total = [0.0], 0.0
            optimizer = node.optimizer_seconds or [0.0] * len(node.layer_seconds)  # node.optimizer(i), read once
            for seconds, step in zip(node.layer_seconds, optimizer):
                total += seconds + step / num_microbatches
                acc.append(total)
            self._time[key] = acc
        return acc

    def pair_floor(self, pipelines: Sequence[PipelineCost], compression: CompressionConfig) -> float:
        """At most plan_step_s(pipelines, self.costs(pipelines, compression)) for two pipelines,
        without pricing a codec: each group's reduction takes at least its bytes at the most
        compressing codec it may use over its link, plus one latency (no codec or cipher work; a
        group of two holders is never hierarchical), and ends no sooner than `priced` has it end
        with that; sharing a link only delays it. The pair search skips the whole sync of a
        split whose floor cannot win."""
        assert len(pipelines) == 2
        drains = _drains(pipelines)
        floor = max(p.step_s for p in pipelines)
        for group in sync_groups([[(s.layer_start, s.layer_end) for s in p.stages] for p in pipelines]):
            d = self.describe(pipelines, drains, group, "ring")  # the shape does not matter with two holders
            if d.bytes > 0:
                least = _least_reduce_s(d.bytes, d.bandwidth, d.latency, compression, d.cross_region)
                floor = max(floor, _reduction_end(d.ready, d.backward, least, d.bytes))
        return floor * (1 - 1e-9)  # below costs()'s rounding

    def first_group_floor(self, first: NodeProfile, second: NodeProfile, compression: CompressionConfig,
                          least_end: int = 1) -> float:
        """What the sync adds at least to the slower of two pipelines whose first stages run on
        `first` and `second`, whatever their cuts and shares, where each first stage holds at least
        `least_end` layers: their sync group G of layers
        [0, g) (g >= least_end) is ready only when the slower pipeline ends (nothing follows a first
        stage's last backward: its drain is 0 and no layer lies below it), and it ends no sooner
        than `priced` says: ready + A / buckets, and ready - backward(G) + A. A is at least G's
        bytes at the most compressing codec it may use over their link plus one latency (no codec
        or cipher work); bytes / buckets is at least min(bytes, half a bucket); and the backward
        of G is taken on one micro-batch (the optimizer's share at its largest). The pair search
        prunes pairs by it before cutting their chains."""
        if self.params[1] <= 0:
            return 0.0
        bandwidth, latency = self._slowest_link([first, second])
        cross = first.region != second.region
        least_end = max(1, least_end)
        streamed = _least_reduce_s(min(self.params[least_end], SYNC_BUCKET_BYTES / 2), bandwidth, 0.0, compression,
                                   cross)
        # _least_reduce_s and _compute at every end g, their arithmetic written out with the ratio and
        # the prefix sums read once: a call of each per layer was a fifth of planning 3,000 layers.
        ratio, time_a, time_b = _least_ratio(compression, cross), self._time_prefix(first, 1), self._time_prefix(second, 1)
        exposed = min(self.params[g] * ratio / bandwidth + latency
                      - BACKWARD_SHARE * max(time_a[g] - time_a[0], time_b[g] - time_b[0])
                      for g in range(least_end, len(self.params)))
        return max(streamed, exposed, 0.0) * (1 - 1e-9)  # below plan_step_s's rounding

    def first_group_tail(self, first: NodeProfile, second: NodeProfile, layers_end: int, shares: tuple[int, int],
                         compression: CompressionConfig) -> float:
        """first_group_floor once the cuts are known: their group of layer 0 holds [0, layers_end)
        (the shorter first stage's layers) and each backward is at its pipeline's share. Below
        what `priced` gives that group past the slower pipeline's step, whatever codec it takes."""
        num_bytes = self.params[layers_end]
        if num_bytes <= 0:
            return 0.0
        bandwidth, latency = self._slowest_link([first, second])
        least = _least_reduce_s(num_bytes, bandwidth, latency, compression, first.region != second.region)
        backward = BACKWARD_SHARE * max(self._compute(first, 0, layers_end, shares[0]),
                                        self._compute(second, 0, layers_end, shares[1]))
        return max(_reduction_end(0.0, backward, least, num_bytes), 0.0) * (1 - 1e-9)

    def _slowest_link(self, nodes: Sequence[NodeProfile]) -> tuple[float, float]:
        """(slowest bandwidth, largest latency) over all pairs. A node without a link of its own is
        represented by its region, so k holders in r regions cost about r² look-ups, once."""
        keys: dict[str, list[NodeProfile]] = {}
        for n in nodes:
            keys.setdefault("node:" + n.name if n.name in self._linked else "region:" + n.region, []).append(n)
        shape = frozenset((key, len(same) > 1) for key, same in keys.items())
        if shape not in self._links:
            reps = list(keys.values())
            pairs = [(a[0], b[0]) for i, a in enumerate(reps) for b in reps[i + 1:]]
            pairs += [(same[0], same[1]) for same in reps if len(same) > 1]
            links = [self.profile.link(a, b) for a, b in pairs]
            self._links[shape] = (min((link.bandwidth_bytes_per_s for link in links), default=math.inf),
                                  max((link.latency_s for link in links), default=0.0))
        return self._links[shape]


def _shapes(d: _Group, topology: str) -> tuple[bool, ...]:
    """The shapes a group may take (False: flat ring, True: hierarchical) under `sync_topology`."""
    if d.tiers is None or d.bytes <= 0:
        return (False,)
    return {"auto": (False, True), "hierarchical": (True,)}.get(topology, (False,))


def _sharing_links(costs: list[SyncCost], readies: list[float], step: float) -> list[SyncCost]:
    """The groups a node holds share its link: taken in the order they become ready, each node's
    link carries its groups one after another (fair sharing of the link ends the last one at
    the same time), and a group ends when the busiest of its holders' links has carried it.
    A node's load is its own groups only: two groups that share no node do not wait for each
    other, even when a third group links them."""
    busy: dict[str, float] = {}
    shared = list(costs)
    for k in sorted(range(len(costs)), key=readies.__getitem__):
        cost = costs[k]
        if cost.allreduce_s == 0.0:
            continue
        start = cost.end_s - cost.allreduce_s  # when it would start with every link to itself
        for n in cost.nodes:
            busy[n] = max(busy.get(n, -math.inf), start) + cost.allreduce_s
        end = max(cost.end_s, max(busy[n] for n in cost.nodes))
        if end != cost.end_s:
            shared[k] = replace(cost, end_s=end, exposed_s=max(0.0, end - step))
    return shared


def _reduction_end(ready: float, backward: float, reduce_s: float, num_bytes: float) -> float:
    """end_G of the module docstring: a group's buckets stream during its own backward, so at
    best only the last bucket is left when the group is final, at worst the reduction itself is
    the bottleneck. `priced` dates a group by it, and the pair search's floors with a reduction
    no codec can beat (_least_reduce_s)."""
    if reduce_s == 0.0:
        return ready
    buckets = max(1, math.ceil(num_bytes / SYNC_BUCKET_BYTES))
    return max(ready + reduce_s / buckets, ready - backward + reduce_s)


def _least_reduce_s(num_bytes: float, bandwidth: float, latency: float, compression: CompressionConfig,
                    cross_region: bool) -> float:
    """What two holders' reduction of `num_bytes` takes at least, whatever codec and shape it
    is priced with: the bytes at the most compressing codec the policy allows, over their link,
    plus one latency (allreduce_s and sealed_gather_s with k = 2, less their codec and cipher work
    and any second hop)."""
    return num_bytes * _least_ratio(compression, cross_region) / bandwidth + latency


def _least_ratio(compression: CompressionConfig, cross_region: bool) -> float:
    """The wire ratio of the most compressing codec the policy allows a sync over such a link."""
    return min(_ratio(codec) for codec in compression.sync_candidates(cross_region))


def _drains(pipelines: Sequence[PipelineCost]) -> list[list[float]]:
    """drain_j per pipeline: what follows stage j's last backward (the gradient's way up to stage 0)."""
    drains = []
    for pipeline in pipelines:
        acc = [0.0]
        for s in pipeline.stages[:-1]:
            acc.append(acc[-1] + BACKWARD_SHARE * s.compute_s + s.latency_s + s.link_s)
        drains.append(acc)
    return drains


@lru_cache(maxsize=None)
def _ratio(codec: str) -> float:
    return codec_info(codec).wire_ratio()
