"""The cost model of one pipeline step — the one place the planner and the benchmarks share.

For a chain of S stages, stage j holding layers [a_j, b_j) on node n_j, M micro-batches:

    t_j   = sum_{l in [a_j, b_j)} layer_seconds[n_j][l]  +  sum_l optimizer_seconds[n_j][l] / M
            (compute per micro-batch; the once-per-step optimizer spread over the micro-batches)
    c_j   = wire_bytes(output_bytes[b_j - 1]) / bandwidth(n_j, n_j+1)      for j < S-1
            (time one activation occupies the link; the gradient going back takes the same
            time on the other direction of a full-duplex link)
    lat_j = latency(n_j, n_j+1)

    step  = the schedule's closed form (runtime/schedules.py closed_step) from
            T = max_j t_j, C = max_j c_j, the fill and drain sum_j t_j + sum_{j<S-1} 2 (lat_j + c_j)
            (one micro-batch's forward down and backward up the chain) and, where a window
            limits the schedule, max_j window_term(RT_j), RT_j = sum_{k>=j} t_k
            + sum_{k>=j, k<S-1} 2 (lat_k + c_k) the round trip from stage j to the end and back
            (its own window's; the cut program of launcher/planning/chain_cuts.py divides by the
            window memory allows the stage, window_cap, the deepest a deepening schedule may give it)

The schedule object owns its closed form and its in-flight counts; nothing here tests a
schedule's name. Stage j holds parameters, gradients and AdamW state (4 x param_bytes) plus
activations for the micro-batches the schedule keeps in flight there. Sends are
asynchronous, so a link is a resource of its own that overlaps with compute rather than
adding to it.
"""

from __future__ import annotations

from dataclasses import replace

from hetlaunch.launcher.planning.compression import LOSSINESS, NONE, CompressionConfig, wire_ratio
from hetlaunch.launcher.planning.pipeline_cost import PipelineCost, copied_stage, made_stage, split_costs
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.sim_floor import floor_of, simulation_floor, stage_shapes
from hetlaunch.launcher.planning.windows import THOROUGH_MAX_ACTIONS, best_windows
from hetlaunch.runtime.registry import STATIC_BYTES_PER_PARAM_BYTE, must_seal
from hetlaunch.runtime.schedules import (compiled, schedule_named, simulate_compiled,
                                         simulate_in_order, simulate_stages, stage_order)


ORDER_MAX_ACTIONS = 20_000  # actions per schedule up to which simulation orders are remembered (CostModel._simulated)
MEMO_MAX_STEPS = 20_000  # simulated steps a CostModel remembers before it starts over: a key holds every
# stage's costs (a few KB on long chains), so this keeps the memo under ~100 MB


def in_flight(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """Micro-batches the schedule itself keeps in flight at this stage (its memory)."""
    return schedule_named(schedule).in_flight(stage_index, num_stages, num_microbatches)


class CostModel:
    """Precomputed prefix sums over a profile, so a stage's cost is O(1)."""

    def __init__(self, profile: Profile, num_microbatches: int, schedule: str = "1f1b",
                 compression: CompressionConfig = NONE):
        if num_microbatches < 1:  # every per-micro-batch share below divides by it
            raise PlanningError(f"a pipeline needs at least one micro-batch (got {num_microbatches})")
        self.profile = profile
        self.M = num_microbatches
        self.schedule = schedule
        # The schedule object (runtime/schedules.py): its action lists, in-flight counts and closed form.
        self.rules = schedule_named(schedule)
        self.compression = compression
        self._ratio = {name: wire_ratio(name) for name in LOSSINESS}  # wire bytes per raw byte
        self.num_layers = profile.model.num_layers
        self._time: dict[str, list[float]] = {}  # filled per node on first use: the planner builds one
        # model per micro-batch count it tries, and a large cluster's chains touch few of its nodes
        per_byte = STATIC_BYTES_PER_PARAM_BYTE + (profile.static_extra_per_param_byte or 0.0)
        self._static = _prefix([per_byte * layer.param_bytes for layer in profile.layers])
        self._activation = _prefix([layer.activation_bytes for layer in profile.layers])
        self._outputs = [layer.output_bytes for layer in profile.layers]
        self._codec_terms: dict[tuple[str, str], tuple[float | None, float]] = {}  # codec_terms, per (node, codec)
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        self._region_links: dict[tuple[str, str], tuple[float, float]] = {}  # link() between unnamed nodes
        self._linked = {name for link in profile.links if link.nodes for name in link.nodes}  # nodes a link names
        self._memory_prefix: dict[int, list[float]] = {}
        self._memory_prefixes: dict[int, list[list[float]]] = {}  # per stage count: memory_prefixes
        self._optimizer: dict[str, list[float]] = {}
        self._layers: dict[str, list[float]] = {}
        self._layer_steps: dict[str, list[float]] = {}  # node -> layer_steps
        self._schedules: dict[tuple[int, int, int], tuple] = {}  # compiled action lists, per stage shape
        self._stage_lists: dict[tuple[int, int, int], tuple | None] = {}  # simulate_stages' lists, per stage shape
        self._orders: dict[tuple[int, ...], tuple] = {}  # per window vector: its actions in an order they can run
        # per priced input (windows, costs): its simulated step; the search prices equal chains and cuts again
        self._steps: dict[tuple, float] = {}
        self._shapes: dict[int, list[tuple]] = {}  # per stage count: what sim_floor.py reads of the action lists
        self._own: dict[int, tuple[int, ...]] = {}  # per stage count: the schedule's own in-flight counts
        # launcher/planning/chain_cuts.py's dynamic program, remembered across the chains it cuts
        self.suffix_fronts: dict[tuple, dict[int, list[tuple]]] = {}
        self.crossings: dict[tuple, dict[str, list]] = {}
        self.squeezed: dict[tuple, str] = {}  # chain_cuts.most_compressed_codecs, per boundary's nodes

    def compute_s(self, node: NodeProfile, start: int, end: int) -> float:
        acc = self._time.get(node.name) or self.time_prefix(node)
        return acc[end] - acc[start]

    def time_prefix(self, node: NodeProfile) -> list[float]:
        """prefix[i] = compute of layers [0, i) on node; a stage's time is a difference of two entries."""
        acc = self._time.get(node.name)
        if acc is None:
            acc, total, M = [0.0], 0.0, self.M
            optimizer = node.optimizer_seconds or [0.0] * self.num_layers  # node.optimizer(i), read once
            for i in range(self.num_layers):
                total += node.layer_seconds[i] + optimizer[i] / M
                acc.append(total)
            self._time[node.name] = acc
        return acc

    def split_backward_s(self, node: NodeProfile, start: int, end: int, stage_index: int, backward_s: float,
                         codec_s: float) -> tuple[float, float]:
        """(I, W) of a stage's split backward per micro-batch from the node's measured parts, or
        (0, 0) where it measured none. A first stage sends no gradient: its I is empty and its W
        one full backward (runtime/split_backward.py). The gradient's codec work goes with I."""
        if node.input_grad_seconds is None or node.weight_grad_seconds is None:
            return 0.0, 0.0
        if stage_index == 0:
            return 0.0, backward_s
        return (sum(node.input_grad_seconds[start:end]) + codec_s, sum(node.weight_grad_seconds[start:end]))

    def optimizer_s(self, node: NodeProfile, start: int, end: int) -> float:
        """The once-per-step optimizer time of layers [start, end) on node."""
        acc = self.optimizer_prefix(node)
        return acc[end] - acc[start]

    def optimizer_prefix(self, node: NodeProfile) -> list[float]:
        acc = self._optimizer.get(node.name)
        if acc is None:
            acc = self._optimizer[node.name] = _prefix((node.optimizer_seconds or [0.0] * self.num_layers)
                                                       [:self.num_layers])  # node.optimizer(i) per layer
        return acc

    def layer_outputs(self) -> list[int]:
        """Each layer's output bytes (what crosses a boundary after it), read out of the profile once."""
        return self._outputs

    def layer_prefix(self, node: NodeProfile) -> list[float]:
        """prefix[i] = the layers [0, i) forward and backward on node, per micro-batch (no optimizer)."""
        acc = self._layers.get(node.name)
        if acc is None:
            acc = self._layers[node.name] = _prefix(node.layer_seconds[:self.num_layers])
        return acc

    def layer_steps(self, node: NodeProfile) -> list[float]:
        """steps[i] = layer_prefix(node)[i + 1] - layer_prefix(node)[i]: layer i's time as the bounds
        read it from the prefix sums (not node.layer_seconds[i], which can differ in the last bit)."""
        steps = self._layer_steps.get(node.name)
        if steps is None:
            acc = self.layer_prefix(node)
            steps = self._layer_steps[node.name] = [b - a for a, b in zip(acc, acc[1:])]
        return steps

    def exact(self, chain: list[NodeProfile], cost: PipelineCost) -> PipelineCost:
        """The same stages, codecs and windows, the step priced by an event simulation of the
        schedule the executor runs (runtime/schedules.py `simulate`) instead of the closed form
        above: each stage's forward_s, backward_s and optimizer_s (see evaluate) and its
        outgoing link. The closed form stays for the search, where it is called thousands of
        times; plans are priced with this, and only this sets `exact`."""
        step = self._simulated([s.window for s in cost.stages], [s.forward_s for s in cost.stages],
                               [s.backward_s for s in cost.stages], [s.link_s for s in cost.stages[:-1]],
                               [s.latency_s for s in cost.stages[:-1]], [s.optimizer_s for s in cost.stages],
                               split_costs(cost.stages))
        return replace(cost, step_s=step, exact=True)

    def _simulated(self, windows: list[int], forward: list[float], backward: list[float], link: list[float],
                   latency: list[float], optimizer: list[float], split: tuple = (None, None)) -> float:
        """The event simulation of stages keeping `windows` in flight (0: their own): by
        simulate_stages where every stage runs only F and B (1F1B, GPipe: the same arithmetic
        without the other kinds' branches), else simulate_compiled."""
        known = (tuple(windows), tuple(forward), tuple(backward), tuple(link), tuple(latency), tuple(optimizer),
                 tuple(split[0] or ()), tuple(split[1] or ()))
        step = self._steps.get(known)
        if step is None:
            if len(self._steps) >= MEMO_MAX_STEPS:
                self._steps.clear()  # a bound on memory; the search rarely asks again after so many
            step = self._steps[known] = self._simulate(windows, forward, backward, link, latency, optimizer, split)
        return step

    def _simulate(self, windows: list[int], forward: list[float], backward: list[float], link: list[float],
                  latency: list[float], optimizer: list[float], split: tuple) -> float:
        S = len(windows)
        key = tuple(windows)
        order = self._orders.get(key)
        if order:
            return simulate_in_order(order, self.M, forward, backward, link, latency, optimizer)
        fast = tuple(self._stage_list(j, S, w) for j, w in enumerate(windows))
        if all(a is not None for a in fast):
            # The order the actions can run in depends on the lists only: recorded when a window
            # vector comes back (most do: every cut at its own windows), then each cut is priced in
            # one pass (runtime/simulation.py simulate_in_order). Not for very long schedules,
            # whose vectors rarely come back and whose orders would fill memory.
            if order is None or 2 * S * self.M > ORDER_MAX_ACTIONS:
                self._orders[key] = ()
                return simulate_stages(fast, forward, backward, link, latency, optimizer)
            order = self._orders[key] = stage_order(fast)
            return simulate_in_order(order, self.M, forward, backward, link, latency, optimizer)
        actions = tuple(self._actions(j, S, w) for j, w in enumerate(windows))
        return simulate_compiled(actions, forward, backward, link, latency, optimizer, *split)

    def _stage_list(self, stage_index: int, num_stages: int, window: int) -> tuple | None:
        key = (stage_index, num_stages, window)
        if key not in self._stage_lists:
            self._stage_lists[key] = self.rules.compiled_list(stage_index, num_stages, self.M, window)
        return self._stage_lists[key]

    def floor(self, cost: PipelineCost) -> float:
        """A step no simulation of this cut can beat, whatever its windows (launcher/planning/sim_floor.py)."""
        return simulation_floor(self.stage_shapes(len(cost.stages)), cost.stages)

    def cut_floor(self, chain: list[NodeProfile], cuts: list[tuple[int, int]], codecs: list[str]) -> float:
        """floor(evaluate(chain, cuts, codecs)), the same arithmetic, without building the stages:
        the search reads the floor of every cut that passes its cheaper tests and simulates only
        the few below its best step. Schedules that run M forwards and M whole backwards per stage
        (forward_backward_only: their shapes count no I or W, so those terms are 0 times a value)."""
        S, M = len(chain), self.M
        ts, cs, lats = self._terms(chain, cuts, codecs)
        f, b, opt = [], [], []
        for j, (node, (start, end)) in enumerate(zip(chain, cuts)):
            acc = self._time.get(node.name) or self.time_prefix(node)
            layers_and_optimizer = acc[end] - acc[start]
            prefix = self._optimizer.get(node.name) or self.optimizer_prefix(node)
            optimizer = prefix[end] - prefix[start]
            layers = layers_and_optimizer - optimizer / M
            codec_work = ts[j] - layers_and_optimizer
            f.append(layers / 3 + codec_work / 2)  # evaluate's forward_s, backward_s and optimizer_s
            b.append(2 * layers / 3 + codec_work / 2)
            opt.append(optimizer)
        half = [x / 2 for x in b]
        return floor_of(self.stage_shapes(S), f, b, half, half, opt, cs, lats)

    def stage_shapes(self, num_stages: int) -> list[tuple]:
        """What sim_floor.py reads of the schedule's action lists (the same for every window)."""
        if num_stages not in self._shapes:
            if self.rules.forward_backward_only:
                # Each stage: M forwards, M backwards, the last action a backward. Counting the
                # lists instead was a fifth of planning a global batch of 4,096 (a list per stage
                # at every micro-batch share); tests/planning/test_search_bounds.py holds it to them.
                self._shapes[num_stages] = [(self.M, self.M, 0, 0, True)] * num_stages
            else:
                self._shapes[num_stages] = stage_shapes(tuple(self._actions(j, num_stages, 0)
                                                              for j in range(num_stages)))
        return self._shapes[num_stages]

    def splits_backward(self, num_stages: int) -> bool:
        """Whether the schedule runs some stage's backward as I and W: priced from the I and W a
        node measured, which need not add up to the B that bounds on whole backwards charge."""
        return any(ni or nw for _, _, ni, nw, _ in self.stage_shapes(num_stages))

    def _actions(self, stage_index: int, num_stages: int, window: int) -> tuple:
        key = (stage_index, num_stages, window)
        if key not in self._schedules:
            self._schedules[key] = compiled([self.rules.stage_actions(stage_index, num_stages, self.M, window)])[0]
        return self._schedules[key]

    def with_windows(self, cost: PipelineCost, windows: tuple[int, ...]) -> PipelineCost:
        """The same stages holding `windows` micro-batches in flight (0 where a stage keeps its own),
        their memory with them; not priced (exact is cleared)."""
        S = len(cost.stages)
        own = self.own_windows(S)
        stages = tuple(copied_stage(stage, window=w if w > own[j] else 0,
                               memory_bytes=self.memory_bytes(stage.layer_start, stage.layer_end, j, S, w or own[j]))
                       for j, (stage, w) in enumerate(zip(cost.stages, windows)))
        return replace(cost, stages=stages, exact=False)

    def deepen(self, chain: list[NodeProfile], cost: PipelineCost, thorough: bool | None = None) -> PipelineCost:
        """A deepening schedule (1F1B) with the windows the simulation prices fastest among those
        memory allows and the executor can run (launcher/planning/windows.py), priced exactly; the
        stages' own windows when nothing deeper pays. Whatever windows `cost` had are searched
        again. `thorough` (default: for schedules of up to THOROUGH_MAX_ACTIONS stages x
        micro-batches) searches every vector or descends from the shaped ones; else only the
        shaped ones are priced."""
        S = len(cost.stages)
        thorough = S * self.M <= THOROUGH_MAX_ACTIONS if thorough is None else thorough
        own = list(self.own_windows(S))
        plain = self.exact(chain, self.with_windows(cost, tuple(own)) if any(s.window for s in cost.stages) else cost)
        if not self.rules.deepens or S == 1:
            return plain
        caps = [self.window_cap(node, stage.layer_start, stage.layer_end, j, S)
                for j, (node, stage) in enumerate(zip(chain, cost.stages))]
        if caps == own:
            return plain
        round_trip, total = [0.0] * S, 0.0
        for j in range(S - 1, -1, -1):
            stage = cost.stages[j]
            total += stage.compute_s + 2 * (stage.latency_s + stage.link_s)
            round_trip[j] = total
        floor = self.floor(cost)
        if plain.step_s <= floor * (1 + 1e-12):
            return plain  # every micro-batch already streams through the busiest resource: nothing to hide
        busiest = max(max(s.compute_s, s.link_s) for s in cost.stages)
        # The vectors are priced from plain lists (the same arithmetic as exact()); only the one
        # kept becomes a PipelineCost, priced again by exact() itself.
        forward, backward = [s.forward_s for s in cost.stages], [s.backward_s for s in cost.stages]
        link, latency = [s.link_s for s in cost.stages[:-1]], [s.latency_s for s in cost.stages[:-1]]
        optimizer = [s.optimizer_s for s in cost.stages]

        def price(windows: tuple[int, ...]) -> float:
            if windows == tuple(own):
                return plain.step_s
            return self._simulated([w if w > own[j] else 0 for j, w in enumerate(windows)], forward, backward, link,
                                   latency, optimizer)

        windows, _ = best_windows(own, caps, round_trip, busiest, price, thorough, floor)
        if windows == tuple(own):
            return plain
        return replace(self.exact(chain, self.with_windows(cost, windows)),
                       bottleneck=f"{plain.bottleneck}; {self.rules.title} windows {list(windows)} keep more "
                                  "micro-batches in flight")

    def window_cap(self, node: NodeProfile, start: int, end: int, stage_index: int, num_stages: int) -> int:
        """The deepest window a deepening schedule may give layers [start, end) at this position on
        this node: as many micro-batches as its memory holds, at most M, at least its own (the
        last stage keeps its own: nothing comes back to it later than its own backward). Its own
        where the schedule does not deepen."""
        own = self.rules.in_flight(stage_index, num_stages, self.M)
        if not self.rules.deepens or stage_index == num_stages - 1:
            return own
        static, per_mb = self._static[end] - self._static[start], self._activation[end] - self._activation[start]
        fits = int((node.memory_bytes - static) // per_mb) if per_mb > 0 else self.M
        return max(own, min(self.M, fits))

    def layer_prefixes(self) -> tuple[list[float], list[float]]:
        """(static bytes, one micro-batch's activation bytes) of layers [0, i), per i."""
        return self._static, self._activation

    def own_windows(self, num_stages: int) -> tuple[int, ...]:
        """Each stage's in-flight count under the schedule itself (its memory's window), per stage count."""
        own = self._own.get(num_stages)
        if own is None:
            own = self._own[num_stages] = tuple(self.rules.in_flight(j, num_stages, self.M) for j in range(num_stages))
        return own

    def memory_prefix(self, stage_index: int, num_stages: int) -> list[float]:
        """prefix[i] = memory of layers [0, i) for a stage at this position (its in-flight window)."""
        window = self.rules.in_flight(stage_index, num_stages, self.M)
        if window not in self._memory_prefix:
            self._memory_prefix[window] = [s + window * a for s, a in zip(self._static, self._activation)]
        return self._memory_prefix[window]

    def memory_prefixes(self, num_stages: int) -> list[list[float]]:
        """memory_prefix of every position of a pipeline of num_stages stages, made once per count."""
        found = self._memory_prefixes.get(num_stages)
        if found is None:
            found = self._memory_prefixes[num_stages] = [self.memory_prefix(j, num_stages) for j in range(num_stages)]
        return found

    def layer_bytes(self, start: int, end: int) -> tuple[float, float]:
        """(static bytes, one micro-batch's activation bytes) of layers [start, end), whatever the schedule."""
        return self._static[end] - self._static[start], self._activation[end] - self._activation[start]

    def memory_bytes(self, start: int, end: int, stage_index: int, num_stages: int, window: int = 0) -> float:
        """Layers [start, end) at this position, with its schedule's in-flight window (or `window`)."""
        window = window or self.rules.in_flight(stage_index, num_stages, self.M)
        return (self._static[end] - self._static[start]) + window * (self._activation[end] - self._activation[start])

    def link(self, a: NodeProfile, b: NodeProfile) -> tuple[float, float]:
        """(bandwidth bytes/s, latency s) between two nodes."""
        key = (a.name, b.name)
        found = self._links.get(key)
        if found is None:
            # Between nodes no link names, the regions' link (Profile.link's second pass): looked
            # up once per pair of regions, not per pair of nodes (a scan of every link each).
            by_regions = a.name not in self._linked and b.name not in self._linked
            found = self._region_links.get((a.region, b.region)) if by_regions else None
            if found is None:
                link = self.profile.link(a, b)
                found = (link.bandwidth_bytes_per_s, link.latency_s)
                if by_regions:
                    self._region_links[a.region, b.region] = found
            self._links[key] = found
        return found

    def codec_options(self, boundary: int, a: NodeProfile, b: NodeProfile) -> tuple[str, ...]:
        return self.compression.candidates(boundary, a.region == b.region)

    def boundary_s(self, a: NodeProfile, b: NodeProfile, after_layer: int, codec: str = "none") -> tuple[float, float]:
        """(transfer, latency) of one micro-batch crossing after `after_layer` between a and b.

        Activations go one way and gradients (same size, maybe another codec) the other; on a
        full-duplex link the busier direction is what occupies it.
        """
        bandwidth, latency = self.link(a, b)
        return self._outputs[after_layer] * self.codec_terms(a, codec)[1] / bandwidth, latency

    def link_seconds_per_byte(self, a: NodeProfile, b: NodeProfile, codec: str = "none") -> float:
        """boundary_s's transfer time per raw byte crossing between a and b."""
        return self.codec_terms(a, codec)[1] / self.link(a, b)[0]

    def codec_s(self, sender: NodeProfile, after_layer: int, codec: str, receiver: NodeProfile | None = None) -> float:
        """Encode + decode work of both directions of a boundary, per micro-batch, and where
        data_plane.encrypt seals the boundary (receiver given), sealing and opening both directions'
        wire bytes.

        Charged to the stage before the boundary (a simplification: in truth each side encodes
        what it sends and decodes what it receives), using that node's measured codec and cipher speed.
        """
        per_byte = self.codec_terms(sender, codec)[0]
        raw = self._outputs[after_layer]
        work = 0.0 if per_byte is None else raw * per_byte
        if receiver is not None and self.seals(sender, receiver):
            backward = self.compression.gradient_codec(codec)
            work += raw * (self._ratio[codec] + self._ratio[backward]) * (sender.cipher_seconds_per_byte or 0.0)
        return work

    def codec_terms(self, sender: NodeProfile, codec: str) -> tuple[float | None, float]:
        """(encode + decode work of both directions per raw byte on the sender — None where the
        boundary is raw both ways, which costs none —, wire bytes per raw byte of the busier
        direction), remembered per sender and codec: codec_s and boundary_s are built on them."""
        terms = self._codec_terms.get((sender.name, codec))
        if terms is None:
            backward = self.compression.gradient_codec(codec)
            per_byte = None if codec == "none" and backward == "none" else \
                sender.codec_cost(codec) + sender.codec_cost(backward)
            terms = self._codec_terms[sender.name, codec] = (per_byte, max(self._ratio[codec], self._ratio[backward]))
        return terms

    def seals(self, a: NodeProfile, b: NodeProfile) -> bool:
        """Does the job's data_plane.encrypt (the profile's, as the planner's caller set it) seal a-b?"""
        mode = self.profile.data_plane_encrypt
        return mode is not None and must_seal(mode, (a.region, b.region))

    def step_s(self, compute_max: float, link_max: float, sum_term: float, window_max: float = 0.0) -> float:
        """The schedule's closed form (see the module docstring)."""
        return self.rules.closed_step(self.M, compute_max, link_max, sum_term, window_max)

    def closed_step(self, compute: list[float], link: list[float], latency: list[float]) -> float:
        """The closed form's step from per-stage compute t_j, outgoing link time c_j and latency
        lat_j (0 after the last stage): plain floats, for callers that try many variations."""
        S, sum_term, round_trip, window_max = len(compute), 0.0, 0.0, 0.0
        for j in range(S - 1, -1, -1):
            hop = compute[j] + 2 * (latency[j] + link[j])
            sum_term += hop
            round_trip += hop
            window_max = max(window_max, self.window_term(round_trip, j, S))
        return self.step_s(max(compute), max(link), sum_term, window_max)

    def window_term(self, round_trip: float, stage_index: int, num_stages: int) -> float:
        """What the stage's in-flight window costs per micro-batch, given its round trip to the end
        of the pipeline and back (1F1B: round_trip / its window; 0 where no window limits)."""
        return self.rules.window_term(round_trip, stage_index, num_stages, self.M)

    def evaluate(self, chain: list[NodeProfile], cuts: list[tuple[int, int]],
                 codecs: list[str] | None = None) -> PipelineCost:
        """The full cost of a chain with given layer ranges and boundary codecs (default none)."""
        S, M = len(chain), self.M
        codecs = codecs or ["none"] * (S - 1)
        ts, cs, lats = self._terms(chain, cuts, codecs)
        step, slowest_stage, slowest_link, window_stage = self._closed(ts, cs, lats)
        stages = []
        # optimizer_s and memory_bytes inlined (the same arithmetic): the search evaluates
        # thousands of chains of up to 48 stages, and the calls were most of the time.
        static, activation = self._static, self._activation
        raw_ratio = max(self._ratio["none"], self._ratio[self.compression.gradient_codec("none")])
        own = self.own_windows(S)
        for j, (node, (start, end)) in enumerate(zip(chain, cuts)):
            acc = self._time.get(node.name) or self.time_prefix(node)
            layers_and_optimizer = acc[end] - acc[start]
            t, c = ts[j], cs[j]
            raw_c = self._outputs[end - 1] * raw_ratio / self.link(node, chain[j + 1])[0] if j < S - 1 else 0.0
            opt = self._optimizer.get(node.name) or self.optimizer_prefix(node)
            optimizer = opt[end] - opt[start]
            layers = layers_and_optimizer - optimizer / M
            codec_work = t - layers_and_optimizer
            input_grad, weight_grad = self.split_backward_s(node, start, end, j, 2 * layers / 3 + codec_work / 2,
                                                            codec_work / 2)
            memory = (static[end] - static[start]) + own[j] * (activation[end] - activation[start])
            stages.append(made_stage(node=node.name, layer_start=start, layer_end=end, compute_s=t, link_s=c,
                                latency_s=lats[j], memory_bytes=memory, capacity_bytes=node.memory_bytes,
                                codec=codecs[j] if j < S - 1 else "none", link_uncompressed_s=raw_c, window=0,
                                forward_s=layers / 3 + codec_work / 2, backward_s=2 * layers / 3 + codec_work / 2,
                                optimizer_s=optimizer, input_grad_s=input_grad, weight_grad_s=weight_grad))
        compute_max = ts[slowest_stage] if slowest_stage >= 0 else 0.0
        link_max = cs[slowest_link] if slowest_link >= 0 else 0.0
        bottleneck = (f"link {chain[slowest_link].name} -> {chain[slowest_link + 1].name}" if link_max > compute_max
                      else f"compute on {chain[slowest_stage].name}" if slowest_stage >= 0 else "")
        if window_stage >= 0:  # never where no window limits: its term is 0
            bottleneck = (f"{self.rules.title} window on {chain[window_stage].name} "
                          "(too few micro-batches in flight for the round trip)")
        return PipelineCost(tuple(stages), self.M, step, bottleneck)

    def closed_form_step(self, chain: list[NodeProfile], cuts: list[tuple[int, int]], codecs: list[str]) -> float:
        """evaluate(chain, cuts, codecs).step_s, the same arithmetic, without building its stages:
        the search ranks most long chains by this alone."""
        return self._closed(*self._terms(chain, cuts, codecs))[0]

    def _terms(self, chain: list[NodeProfile], cuts: list[tuple[int, int]],
               codecs: list[str]) -> tuple[list[float], list[float], list[float]]:
        """Per stage, the closed form's inputs: t_j (its layers, its optimizer share and its
        outgoing boundary's codec work), c_j and lat_j of its outgoing link (0 on the last stage).
        compute_s and boundary_s inlined (the same arithmetic)."""
        S, outputs = len(chain), self._outputs
        sealing = self.profile.data_plane_encrypt is not None
        ts, cs, lats = [], [], []
        for j, (node, (start, end)) in enumerate(zip(chain, cuts)):
            acc = self._time.get(node.name) or self.time_prefix(node)
            t = acc[end] - acc[start]
            c = lat = 0.0
            if j < S - 1:
                receiver, codec = chain[j + 1], codecs[j]
                per_byte, ratio = self._codec_terms.get((node.name, codec)) or self.codec_terms(node, codec)
                if sealing:
                    t += self.codec_s(node, end - 1, codec, receiver)
                elif per_byte is not None:  # codec_s's raw * (encode + decode), without the seal
                    t += outputs[end - 1] * per_byte
                bandwidth, lat = self._links.get((node.name, receiver.name)) or self.link(node, receiver)
                c = outputs[end - 1] * ratio / bandwidth
            ts.append(t)
            cs.append(c)
            lats.append(lat)
        return ts, cs, lats

    def _closed(self, ts: list[float], cs: list[float], lats: list[float]) -> tuple[float, int, int, int]:
        """The closed form's step from the stages' terms, and the stages holding the compute
        maximum, the link maximum and (where it is the largest term) the window's (-1: none)."""
        S = len(ts)
        compute_max = link_max = sum_term = 0.0
        slowest_stage = slowest_link = -1
        for j in range(S):
            t, c = ts[j], cs[j]
            if t > compute_max:
                compute_max, slowest_stage = t, j
            if c > link_max:
                link_max, slowest_link = c, j
            sum_term += t + 2 * (lats[j] + c)
        # The schedule's in-flight window (1F1B's): the round trip from each stage to the end and back.
        window_max, window_stage, round_trip = 0.0, -1, 0.0
        for j in range(S - 1, -1, -1):
            round_trip += ts[j] + 2 * (lats[j] + cs[j])
            w = self.window_term(round_trip, j, S)
            if w > window_max:
                window_max, window_stage = w, j
        if not window_max > max(compute_max, link_max):
            window_stage = -1
        return self.step_s(compute_max, link_max, sum_term, window_max), slowest_stage, slowest_link, window_stage


def _prefix(values: list[float]) -> list[float]:
    acc, total = [0.0], 0.0
    for v in values:
        total += v
        acc.append(total)
    return acc
