"""Plans for schedules where each node holds several stages of one pipeline (interleaved 1F1B, ZB-V).

The nodes and their order are 1F1B's: the planner's one-pipeline plan under 1F1B chooses the
chain of D nodes (launcher/planning/planner.py), so these schedules run where 1F1B would. The
model is then cut into v·D contiguous stages, stage s on the node the schedule places it on
(runtime/device_schedules.py `stage_device`), and the cut is chosen by the simulation the
executor's order obeys (runtime/simulation.py `simulate_devices`):

* each stage's forward is a third of its layers' profiled time on its node, its backward two
  thirds (the I and W halves as the node measured them, else halved), as CostModel.evaluate
  prices a one-stage-per-node pipeline; a node's optimizer step is its stages' sum, once;
* a boundary between two nodes costs what the profiled link takes for the activation after its
  last layer, uncompressed unless `compression.boundaries` pins a codec on it (then at the codec's
  bytes, its work on the sending stage, as CostModel.evaluate prices one); one inside a node costs
  nothing (an in-memory hand-off, runtime/local_link.py);
* a node holds its stages' parameters, gradients and AdamW state, and for activations the most
  micro-batch stages its action list holds at once times each stage's activation: an upper bound,
  which must fit the node's memory.

The cut is a local search: from an even split and from one proportional to the nodes' speed, move
one boundary by one layer while the simulated step falls (a first-improvement hill climb, every
candidate simulated). Under ZB-V the cut is then climbed again under the order built at its
stages' own costs (runtime/device_schedules.py `timed_zb_v`, links and latency included), the
order built again at the cut reached, and kept where it simulates faster than the unit order and
fits (`PipelineCost.device_order` "timed"); the stage commands carry each node's list
(StageSpec.device_order). Each pipeline's step is `simulate_devices` of exactly the stages,
placement, micro-batches and order returned (`check_device_priced`, which builds the lists again
from the stages).

Several pipelines (`max_pipelines` above 1): 1F1B's plan with that many pipelines at most chooses
them (their chains of nodes and their shares of the micro-batches); each is cut as above for its
own share, and their gradient sync is priced by launcher/planning/sync_cost.py over those cuts
(codecs as `compression.sync` allows). A group is ready when, in each holder pipeline's
simulated step, the stage holding it has ended its last backward or weight gradient (where the
worker starts that stage's sync, runtime/executor.py); its reduction is priced from there by
sync_cost.py's closed form, with no overlap credited inside that last action. The plan's step is
the later of the slowest pipeline's simulated step and the last sync group's end.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

from hetlaunch.launcher.planning.compression import NONE, CompressionConfig
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost, StageCost, split_costs
from hetlaunch.launcher.planning.planner import PlanInvariantError, PlannedPipeline, PlannerResult, plan
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.sync_cost import plan_step_s, sync_costs
from hetlaunch.runtime.schedules import (B, W, compiled, device_schedule_named, in_flight_by_device,
                                         simulate_compiled, simulate_devices, simulated_timeline, split_backward,
                                         timed_zb_v)

# What a several-pipeline device plan's step is made of, said wherever the plan is shown.
SYNC_PRICING = ("each pipeline's step by event simulation of its device schedule; the gradient sync by the closed "
                "form of launcher/planning/sync_cost.py from when every holder's stage has ended its last backward "
                "or weight gradient in that simulation (links shared in ready order); the plan's step is the later "
                "of the two")
MAX_SEARCH_ROUNDS = 10_000  # boundary moves; each lowers the step, so the climb ends long before on real models


TIMED = "timed"  # PipelineCost.device_order: ZB-V's order built at the stages' own costs


def plan_devices(profile: Profile, num_microbatches: int, schedule: str, max_pipelines: int = 1,
                 compression: CompressionConfig = NONE) -> PlannerResult:
    """The plan of `schedule` (interleaved-1f1b or zb-v) on 1F1B's chains of nodes, `max_pipelines`
    of them at most; PlanningError if the model has too few layers for v·D stages, a pipeline's
    micro-batches do not suit the schedule, or no cut fits the nodes' memory. Of `compression`
    the pinned `boundaries` (after stage s of each pipeline, between two nodes; their gradients
    take the same codec) and the gradient sync's settings apply: every other boundary runs
    uncompressed."""
    started = time.perf_counter()
    placed = device_schedule_named(schedule)
    base = plan(profile, num_microbatches, "1f1b", max_pipelines=max_pipelines)
    several = len(base.pipelines) > 1
    # What applies of `compression`: the pinned boundaries (their gradients take the same codec:
    # `gradients` would put a codec on every boundary, which these plans leave uncompressed) and the sync's.
    policy = NONE.model_copy(update={"boundaries": dict(compression.boundaries), "sync": compression.sync,
                                     "sync_topology": compression.sync_topology})
    excluded = dict(base.excluded)
    costs = []
    for i, p in enumerate(base.pipelines):
        cost, left_out = _cut_in_rounds(profile, [profile.node(s.node) for s in p.cost.stages],
                                        p.cost.num_microbatches, schedule, policy,
                                        f"pipeline {i} takes {p.cost.num_microbatches} of the {num_microbatches} "
                                        f"micro-batches: " if several else "")
        costs.append(cost)
        excluded.update(left_out)
    sync = []
    if len(costs) > 1:
        done = [_weights_final(schedule, c) for c in costs]
        sync = sync_costs(profile, costs, policy, ready=lambda g: max(done[p][j] for p, j in g.holders))
    step = plan_step_s(costs, sync)
    tokens = num_microbatches * profile.micro_batch_size * profile.seq_len
    regions = {n.name: n.region for n in profile.nodes}
    counts = [len({s.node for s in c.stages}) for c in costs]
    on = {d: f"{placed.num_stages(d)} stages on {d} node{'s' if d != 1 else ''}" for d in counts}
    where = " and ".join(on[d] for d in counts)
    if len(counts) > 1 and len(set(counts)) == 1:
        where = f"{len(counts)} pipelines, each {on[counts[0]]}"
    return PlannerResult(pipelines=[PlannedPipeline(c, tuple(regions[s.node] for s in c.stages)) for c in costs],
                         step_s=step, tokens_per_s=tokens / step, excluded=excluded,
                         method=f"{base.method} (1F1B's nodes), "
                                f"{' and '.join(str(placed.num_stages(d)) for d in counts)} stages cut by simulation"
                                + (", each node's order built at its stages' costs" if any(c.device_order == TIMED
                                                                                          for c in costs) else ""),
                         planning_s=time.perf_counter() - started, micro_batch_size=profile.micro_batch_size,
                         schedule=schedule, compression=policy, sync=sync,
                         sync_pricing=SYNC_PRICING if len(costs) > 1 else "",
                         schedule_choice=f"{placed.title}: {where}, {placed.stages_per_device} each")


MAX_SUBCHAINS = 64  # sub-chains of one size tried when a chain's node count does not suit the micro-batches


def _cut_in_rounds(profile: Profile, chain: list[NodeProfile], num_microbatches: int, schedule: str,
                   policy: CompressionConfig, share: str) -> tuple[PipelineCost, dict[str, str]]:
    """_cut on the chain, or, where its node count does not divide the micro-batches (interleaved
    1F1B runs them in rounds of its devices), on the best of its sub-chains, in order, of the
    most nodes that does (2 at least): (the cost, the nodes left out with why). Three nodes at 4
    micro-batches were refused, and so was a recovery whose survivors did not divide them."""
    placed, M = device_schedule_named(schedule), num_microbatches
    try:
        placed.actions(len(chain), M)
    except ValueError:
        for size in range(len(chain) - 1, 1, -1):
            if M % size:
                continue
            subs = list(itertools.islice(itertools.combinations(chain, size), MAX_SUBCHAINS + 1))
            if len(subs) > MAX_SUBCHAINS:  # the fastest nodes, in the chain's order
                fastest = {n.name for n in sorted(chain, key=lambda n: sum(n.layer_seconds))[:size]}
                subs = [tuple(n for n in chain if n.name in fastest)]  # by name: a NodeProfile is not hashable
            found = []
            for sub in subs:
                try:
                    found.append(_cut(profile, list(sub), M, schedule, policy, share))
                except PlanningError:
                    continue
            if found:
                best = min(found, key=lambda c: c.step_s)
                kept = {s.node for s in best.stages}
                why = (f"{placed.title} runs micro-batches in rounds of its nodes: {M} suit {size} of this "
                       f"pipeline's {len(chain)}")
                return best, {n.name: why for n in chain if n.name not in kept}
    return _cut(profile, chain, M, schedule, policy, share), {}


def _cut(profile: Profile, chain: list[NodeProfile], num_microbatches: int, schedule: str,
         policy: CompressionConfig = NONE, share: str = "") -> PipelineCost:
    """One pipeline of `schedule` over `chain` at its `num_microbatches`, cut by the search;
    `share` says which pipeline's micro-batches an unsuitable count is (several pipelines)."""
    placed = device_schedule_named(schedule)
    D, L = len(chain), profile.model.num_layers
    S = placed.num_stages(D)
    if S > L:
        raise PlanningError(f"{placed.title} on {D} nodes needs {S} stages but the model has only {L} layers")
    try:
        actions = placed.actions(D, num_microbatches)
    except ValueError as err:
        advice = "set train.num_microbatches or train.max_pipelines to suit it" if share else \
            "set train.num_microbatches to one"
        raise PlanningError(f"{share}{err} ({advice})") from None
    search = _CutSearch(CostModel(profile, num_microbatches, "1f1b", policy), chain, placed, actions,
                        policy.boundaries)
    best = None
    for start in (_even(L, S), _by_speed(search, L)):
        found = search.climb(start)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:  # both starts overflow a node: climb from one that gives each node layers by its memory
        best = search.climb(_by_memory(search, L))
    if best is None:
        raise PlanningError(f"no cut of {L} layers into {S} stages of {placed.title} over "
                            f"{' -> '.join(n.name for n in chain)} fits the nodes' memory")
    cost = search.cost(best[1])
    if schedule == "zb-v":
        cost = _with_timed_order(search, cost, best[1])
    check_device_priced(schedule, D, cost)
    return cost


def device_lists(schedule: str, num_devices: int, num_microbatches: int, order: str, stages) -> list[list]:
    """Each device's actions as a pipeline of these stages runs them: the schedule's own order, or
    with `order` "timed" (ZB-V) the order runtime/device_schedules.py timed_zb_v builds at the
    forward, input and weight gradients and wire times the stages were priced with. `stages`:
    StageCost or StagePlan (the same fields); the planner, the predicted trace and the stage
    commands all build the lists here, so what runs is what was priced."""
    if order != TIMED:
        return device_schedule_named(schedule).actions(num_devices, num_microbatches)
    if schedule != "zb-v":
        raise ValueError(f"a timed order is ZB-V's, not {schedule}'s")
    backward = [s.backward_s for s in stages]
    measured = all((s.input_grad_s or 0.0) + (s.weight_grad_s or 0.0) > 0 for s in stages)
    input_grad, weight_grad = split_backward(backward, [s.input_grad_s for s in stages] if measured else None,
                                             [s.weight_grad_s for s in stages] if measured else None)
    wire = [(s.link_s or 0.0) + (s.latency_s or 0.0) for s in stages[:-1]]
    return timed_zb_v(num_devices, num_microbatches, [s.forward_s for s in stages], input_grad, weight_grad, wire)


def _with_timed_order(search: "_CutSearch", cost: PipelineCost, bounds: tuple[int, ...]) -> PipelineCost:
    """The cut under ZB-V's order built at its stages' costs (timed_zb_v), climbed again under that
    order, and the order built again at the cut it reaches (so the plan's order is a function of
    its own stages): kept where it simulates faster and fits, else `cost` (the unit order). The
    unit order leaves devices idle while an activation crosses a slow link; on 4 nodes with 20 ms
    links (the zero_bubble bench) the timed order priced a step 12% shorter."""
    D, M = search.D, search.cm.M
    try:
        first = _CutSearch(search.cm, search.chain, search.placed, device_lists("zb-v", D, M, TIMED, cost.stages),
                           search.codecs)
        found = first.climb(bounds)
        if found is None:
            return cost
        final = _CutSearch(search.cm, search.chain, search.placed,
                           device_lists("zb-v", D, M, TIMED, first.cost(found[1]).stages), search.codecs)
    except RuntimeError:  # the timed builder found no way on (not seen): the unit order stands
        return cost
    priced = final.cost(found[1])
    if priced.step_s < cost.step_s * (1 - 1e-12) and final.fits(priced):
        return replace(priced, device_order=TIMED)
    return cost


def _weights_final(schedule: str, cost: PipelineCost) -> list[float]:
    """When each stage's last backward or weight gradient ends in the pipeline's simulated step
    (from its start): the worker starts that stage's gradient sync there (runtime/executor.py)."""
    stages = cost.stages
    D = len({s.node for s in stages})
    timeline = simulated_timeline(device_lists(schedule, D, cost.num_microbatches, cost.device_order, stages),
                                  [s.forward_s for s in stages],
                                  [s.backward_s for s in stages], [s.link_s for s in stages[:-1]],
                                  [s.latency_s for s in stages[:-1]], *split_costs(stages))
    done = [0.0] * len(stages)
    for actions in timeline:
        for action, _, end in actions:
            if action.kind in (B, W):
                done[action.stage_index] = max(done[action.stage_index], end)
    return done


def check_device_priced(schedule: str, num_devices: int, cost: PipelineCost) -> None:
    """PlanInvariantError unless the plan's step is `simulate_devices` of exactly its stages, with the
    action lists built afresh (the schedule's, or the timed order from the stages' costs) and every
    boundary inside a node free."""
    placed = device_schedule_named(schedule)
    stages = cost.stages
    where = [placed.stage_device(s, num_devices) for s in range(len(stages))]
    if len(stages) != placed.num_stages(num_devices) or any(
            stages[s].node != stages[where.index(where[s])].node for s in range(len(stages))):
        raise PlanInvariantError(f"planner bug: {len(stages)} stages do not follow {placed.title}'s placement "
                                 f"on {num_devices} nodes")
    optimizer = [sum(s.optimizer_s for j, s in enumerate(stages) if where[j] == d) for d in range(num_devices)]
    want = simulate_devices(device_lists(schedule, num_devices, cost.num_microbatches, cost.device_order, stages),
                            [s.forward_s for s in stages],
                            [s.backward_s for s in stages], [s.link_s for s in stages[:-1]],
                            [s.latency_s for s in stages[:-1]], optimizer, *split_costs(stages))
    if not cost.exact or abs(want - cost.step_s) > 1e-9 * max(want, 1e-12):
        raise PlanInvariantError(f"planner bug: {placed.title} over {', '.join(s.node for s in stages)} reports "
                                 f"{cost.step_s:.6g} s per step but its stages simulate to {want:.6g} s")


class _CutSearch:
    """Prices cuts (the v·D - 1 boundaries, as layer indices) of one chain under one schedule."""

    def __init__(self, cm: CostModel, chain: list[NodeProfile], placed, actions, codecs: dict[int, str] | None = None):
        """`codecs`: boundary (after stage s) -> the codec pinned on it; every other boundary none."""
        self.cm, self.chain, self.placed = cm, chain, placed
        self.D = len(chain)
        self.S = placed.num_stages(self.D)
        self.device = [placed.stage_device(s, self.D) for s in range(self.S)]
        self.codecs = dict(codecs or {})
        for boundary in self.codecs:
            if not 0 <= boundary < self.S - 1:
                raise PlanningError(f"compression.boundaries names boundary {boundary}, but {placed.title} on "
                                    f"{self.D} nodes has boundaries 0 to {self.S - 2}")
            if self.device[boundary] == self.device[boundary + 1]:
                raise PlanningError(f"compression.boundaries pins boundary {boundary}, which {placed.title} keeps "
                                    f"inside node {chain[self.device[boundary]].name} (an in-memory hand-off, "
                                    f"no codec)")
        self.actions = actions
        self.plan = compiled(actions)
        self.in_flight = in_flight_by_device(actions)

    def cost(self, bounds: tuple[int, ...]) -> PipelineCost:
        """Every stage's cost for the cut `bounds`, the step simulated (exact)."""
        edges = (0, *bounds, self.cm.num_layers)
        stages = []
        for s in range(self.S):
            a, b, node = edges[s], edges[s + 1], self.chain[self.device[s]]
            optimizer = self.cm.optimizer_s(node, a, b)
            layers = self.cm.compute_s(node, a, b) - optimizer / self.cm.M
            link = latency = raw = codec_work = 0.0
            codec = self.codecs.get(s, "none")
            if s < self.S - 1 and self.device[s + 1] != self.device[s]:
                after = self.chain[self.device[s + 1]]
                link, latency = self.cm.boundary_s(node, after, b - 1, codec)
                raw = self.cm.boundary_s(node, after, b - 1)[0]
                # as CostModel.evaluate: the codec's work on the sending stage, half each way (an
                # uncompressed boundary's sealing is left unpriced here, as these plans always did)
                codec_work = self.cm.codec_s(node, b - 1, codec, after) if codec != "none" else 0.0
            static, activation = self.cm.layer_bytes(a, b)
            backward = 2 * layers / 3 + codec_work / 2
            i_cost, w_cost = self.cm.split_backward_s(node, a, b, s, backward, codec_work / 2)
            stages.append(StageCost(node.name, a, b, layers + codec_work + optimizer / self.cm.M, link, latency,
                                    static + self.in_flight[self.device[s]] * activation, node.memory_bytes,
                                    codec if s < self.S - 1 else "none", raw,
                                    forward_s=layers / 3 + codec_work / 2, backward_s=backward,
                                    optimizer_s=optimizer, input_grad_s=i_cost, weight_grad_s=w_cost))
        optimizer = [sum(st.optimizer_s for j, st in enumerate(stages) if self.device[j] == d) for d in range(self.D)]
        step = simulate_compiled(self.plan, [s.forward_s for s in stages], [s.backward_s for s in stages],
                                 [s.link_s for s in stages[:-1]], [s.latency_s for s in stages[:-1]], optimizer,
                                 *split_costs(stages))
        busiest = max(range(self.D), key=lambda d: sum(st.compute_s for j, st in enumerate(stages)
                                                       if self.device[j] == d))
        return PipelineCost(tuple(stages), self.cm.M, step, f"compute on {self.chain[busiest].name}", exact=True)

    def fits(self, cost: PipelineCost) -> bool:
        """Each node's stages together within its memory."""
        held = [0.0] * self.D
        for j, stage in enumerate(cost.stages):
            held[self.device[j]] += stage.memory_bytes
        return all(held[d] <= self.chain[d].memory_bytes for d in range(self.D))

    def climb(self, bounds: tuple[int, ...]) -> tuple[float, tuple[int, ...]] | None:
        """(step, cut) where moving no one boundary by one layer lowers the simulated step among
        cuts that fit memory, starting from `bounds`; None if the start does not fit."""
        cost = self.cost(bounds)
        if not self.fits(cost):
            return None
        step, L = cost.step_s, self.cm.num_layers
        for _ in range(MAX_SEARCH_ROUNDS):
            improved = False
            for k in range(len(bounds)):
                for delta in (-1, 1):
                    moved = bounds[k] + delta
                    low = bounds[k - 1] if k > 0 else 0
                    high = bounds[k + 1] if k + 1 < len(bounds) else L
                    if not low < moved < high:
                        continue
                    candidate = (*bounds[:k], moved, *bounds[k + 1:])
                    priced = self.cost(candidate)
                    if priced.step_s < step * (1 - 1e-12) and self.fits(priced):
                        bounds, step, improved = candidate, priced.step_s, True
            if not improved:
                break
        return step, bounds


def _even(num_layers: int, num_stages: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    return tuple(sum(sizes[:s + 1]) for s in range(num_stages - 1))


def _by_speed(search: _CutSearch, num_layers: int) -> tuple[int, ...]:
    """Layers to each stage in proportion to its node's speed (its whole-model time's inverse),
    at least one each."""
    speed = [1.0 / max(search.cm.compute_s(search.chain[d], 0, num_layers), 1e-12) for d in search.device]
    return _proportional(speed, num_layers)


def _by_memory(search: _CutSearch, num_layers: int) -> tuple[int, ...]:
    """Layers to each stage in proportion to its share of its node's memory (a node's stages split
    it evenly), at least one each: where a small node overflowed under the even and the speed
    starts, ZB-V and interleaved 1F1B refused a chain with cuts that fit (a hostile review)."""
    held = [search.device.count(d) for d in range(search.D)]
    return _proportional([float(search.chain[d].memory_bytes) / held[d] for d in search.device], num_layers)


def _proportional(weights: list[float], num_layers: int) -> tuple[int, ...]:
    """The boundaries giving stage s about weights[s] / sum of the layers, at least one each."""
    num_stages, total, bounds, reached = len(weights), sum(weights), [], 0.0
    for s in range(num_stages - 1):
        reached += weights[s] / total * num_layers
        low = (bounds[-1] if bounds else 0) + 1
        bounds.append(min(max(round(reached), low), num_layers - (num_stages - 1 - s)))
    return tuple(bounds)

