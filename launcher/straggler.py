"""Stragglers: a node that stays slower (or faster) than its calibrated speed, and a plan that fits
the speeds the cluster has now.

Calibration (launcher/calibration.py) gives each node's measured ÷ predicted compute. From
then on every step's measured compute per micro-batch is compared with that calibrated
expectation, relative to the nodes' typical ratio (their lower median): a machine that slows every
node alike is no straggler (on a noisy 2-core VM such a slowdown once triggered a switch to a
plan that crowded three agents on the two cores). When one node's stays off by more than
THRESHOLD (either way) for K steps in a row, its new relative speed is the median of those K
steps, an event `straggler` is written, and two plans are priced on the calibrated profile
with that speed:

* a live move (launcher/live_move.py): the same nodes at the same places, new cuts; it costs
  the predicted transfer of the moved layers plus one step held at the boundary, and happens
  within a step or two, in the running workers;
* a new plan from the planner: it may reorder or drop nodes, but switching to it restarts the
  stages at the next committed checkpoint (the cost: the slow steps until that checkpoint, this
  generation's start-up and two steps redone; events `rebalance`, then `restart`).

The one predicted to save more over the remaining steps, net of its cost, is taken, if it saves
anything at all.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.calibration import LINK_MARGIN_S, boundary_transit, expected_transit, with_link
from hetlaunch.launcher.planning.profile_file import LinkProfile, Profile
from hetlaunch.launcher.run_record import StepRecord

THRESHOLD = 1.5  # a node is off its calibrated speed when slower or faster than this factor
K = 5  # ... for this many steps in a row


class StragglerWatch:
    def __init__(self, total_steps: int, replan: Callable[[Profile], Plan | None],
                 price: Callable[[Profile, Plan], float | None], switch: bool = True,
                 recut: Callable[[Profile, Plan], Plan | None] | None = None,
                 move_cost: Callable[[Profile, Plan, Plan], float] | None = None, checkpoint_every: int = 0,
                 offsets: Callable[[], dict[str, tuple[float, float]]] | None = None):
        """`replan(profile)`: the planner's plan for it (None if none); `price(profile, plan)`: the
        step time of `plan` on `profile` (None if it cannot run there); `switch`: False only
        reports stragglers (train.rebalance: off); `recut(profile, plan)`: the best cuts of the
        plan's own pipelines (None: no live moves) and `move_cost(profile, plan, target)` the
        seconds its transfers take; `checkpoint_every` 0: no restarts (nothing to restart from);
        `offsets()` each node's clock offset to the coordinator's (a transit spans two hosts)."""
        self.total_steps, self.replan, self.price, self.switch = total_steps, replan, price, switch
        self.recut, self.move_cost, self.checkpoint_every = recut, move_cost, checkpoint_every
        self.offsets = offsets
        self._slow_links: dict[tuple[str, str], list[tuple[float, int]]] = {}
        self.pending: Plan | None = None  # a better plan to switch to at the next checkpoint
        self.pending_live: Plan | None = None  # ... or to move to now, in the running stages
        self.found: list[dict] = []  # every straggler seen, for events and the summary
        self._plan: Plan | None = None
        self._profile: Profile | None = None
        self._factors: dict[str, float] = {}
        self._off: dict[str, list[float]] = {}
        self._switched_to: Plan | None = None
        self._moving = False  # a live move is under way: the plan it leaves is no longer the one to judge
        self._launched = time.time()  # when this generation was launched
        self._startup_s: float | None = None  # from its launch to its first step reported

    def calibrated(self, plan: Plan, profile: Profile, factors: dict[str, float]) -> None:
        """The plan now running, its calibrated profile, and the factors calibration measured."""
        self._plan, self._profile, self._factors, self._off = plan, profile, dict(factors), {}

    def new_plan(self, plan: Plan) -> None:
        """A generation is launched. The plan switched to was made from the corrected profile, so it
        is watched against its own predictions; another one (after a lost node) is not watched."""
        self._launched, self._startup_s = time.time(), None
        if plan is self._switched_to:
            self._plan, self._factors, self._off = plan, {s.node: 1.0 for s in plan.stages}, {}
        elif plan is not self._plan:
            self._plan, self._off = None, {}
        self.pending = self.pending_live = self._switched_to = None
        self._moving = False

    def take_live(self) -> Plan:
        """The pending live move's plan, now being moved to."""
        target, self.pending_live, self._moving = self.pending_live, None, True
        return target

    def moved(self, plan: Plan) -> None:
        """The live move is done: `plan` runs now, priced on the corrected profile (its own predictions hold)."""
        self._plan, self._factors, self._off, self._moving = plan, {s.node: 1.0 for s in plan.stages}, {}, False
        self._slow_links = {}

    def move_cancelled(self) -> None:
        """The live move did not happen: the plan it would have left runs on and is watched again."""
        self._off, self._slow_links, self._moving = {}, {}, False

    def take(self) -> Plan:
        """The pending plan, now being switched to."""
        self._switched_to, self.pending = self.pending, None
        return self._switched_to

    def add(self, record: StepRecord) -> dict | None:
        """Count a step; a straggler found (and whether to switch) the step it is found, else None."""
        if self._startup_s is None:
            self._startup_s = max(0.0, record.time - self._launched)
        # Steps that run while a live move is asked for or under way still show the plan it
        # leaves: judged against it, they would ask again for the move already being made.
        if self._plan is None or self.pending is not None or self.pending_live is not None or self._moving:
            return None
        shares = self._plan.pipeline_microbatches
        by_node = {s["node"]: s for s in record.stages}
        ratios = {stage.node: by_node[stage.node]["compute_s"] / shares[stage.pipeline]
                  / (stage.compute_s * self._factors[stage.node])
                  for stage in self._plan.stages if stage.node in by_node and stage.compute_s}
        # Against the nodes' typical ratio (the lower median: with two nodes, the less changed
        # one): a host (or a VM) that slows every node alike changes no node's share, and no plan
        # would fix it; a node that changed against the rest does.
        typical = statistics.median_low(ratios.values()) if len(ratios) > 1 else None
        for node, ratio in ratios.items():
            if typical is None:
                continue
            relative = ratio / typical
            off = self._off.setdefault(node, [])
            if relative > THRESHOLD or relative < 1 / THRESHOLD:
                off.append(relative)
            else:
                off.clear()
            if len(off) >= K:
                return self._found(node, statistics.median(off), record.step)
        return self._watch_links(record)

    def _watch_links(self, record: StepRecord) -> dict | None:
        """Each boundary's forward link: the least transit of an activation this step, on one clock,
        against the calibrated profile's latency + bytes / bandwidth (launcher/calibration.py)."""
        offsets = self.offsets() if self.offsets is not None else {}
        by_node = {s["node"]: s for s in record.stages}
        for stages in self._plan.pipelines():
            for up, down in zip(stages, stages[1:]):
                transit = boundary_transit(by_node, up.node, down.node, offsets)
                expected = None if transit is None else expected_transit(self._profile, up.node, down.node, transit[1])
                if expected is None:
                    continue
                slow = self._slow_links.setdefault((up.node, down.node), [])
                if transit[0] > THRESHOLD * expected[0] and transit[0] - expected[0] > LINK_MARGIN_S:
                    slow.append(transit)
                else:
                    slow.clear()
                if len(slow) >= K:
                    return self._found_link(up.node, down.node, expected[1], slow, record.step)
        return None

    def _found_link(self, a: str, b: str, link: LinkProfile, samples: list[tuple[float, int]], step: int) -> dict:
        """The link between a and b carries what its K slow transits say; plan again with that."""
        self._slow_links = {}
        self._profile = with_link(self._profile, a, b, link, statistics.median(s for s, _ in samples),
                                  statistics.median(n for _, n in samples))
        mbps, profiled = self._profile.links[0].bandwidth_bytes_per_s * 8 / 1e6, link.bandwidth_bytes_per_s * 8 / 1e6
        return self._decide(step, {"link": [a, b], "bandwidth_mbps": round(mbps, 3), "profiled_mbps": round(profiled, 3),
                                   "what": f"link {a} -> {b} carries {mbps:,.1f} Mbit/s (profiled {profiled:,.1f})"})

    def _found(self, node: str, ratio: float, step: int) -> dict:
        self._off = {}
        self._factors[node] *= ratio
        profile = self._profile.model_copy(update={"nodes": [
            n.model_copy(update={"layer_seconds": [t * ratio for t in n.layer_seconds],
                                 "optimizer_seconds": None if n.optimizer_seconds is None else
                                 [t * ratio for t in n.optimizer_seconds]}) if n.name == node else n
            for n in self._profile.nodes]})
        self._profile = profile
        return self._decide(step, {"node": node, "speed_vs_calibrated": round(1 / ratio, 4),
                                   "what": f"node {node} runs at {1 / ratio:.2f}x its calibrated speed"})

    def _decide(self, step: int, found: dict) -> dict:
        """Price the running plan, a live re-cut and a new plan on the corrected profile; take the
        way that gains the most net of its cost, if any."""
        profile = self._profile
        now = self.price(profile, self._plan)
        left = self.total_steps - step - 1
        candidate = self.replan(profile)
        later = None if candidate is None else candidate.predicted_step_s
        gain_s = left * (now - later) if now is not None and later is not None else 0.0
        # A restart waits for the next checkpoint at today's speed, starts a generation, redoes two steps.
        # Without checkpoints there is nothing to restart from before the end: only a live move.
        if self.checkpoint_every:
            to_checkpoint = (self.checkpoint_every - (step + 1) % self.checkpoint_every) % self.checkpoint_every
            cost_s = ((self._startup_s or 0.0) + 2 * (now or 0.0)
                      + to_checkpoint * max(0.0, (now or 0.0) - (later or 0.0)))
        else:
            cost_s = float("inf")
        live = self.recut(profile, self._plan) if self.recut is not None and now is not None else None
        live_gain_s = live_cost_s = 0.0
        if live is not None:
            live_gain_s = left * (now - live.predicted_step_s)
            live_cost_s = self.move_cost(profile, self._plan, live) + now  # the transfers, a step held
        mode = None
        if live is not None and live_gain_s - live_cost_s > max(0.0, gain_s - cost_s):
            mode = "live"
        elif gain_s > cost_s:
            mode = "restart"
        found = {**found, "step": step, "step_s_now": now, "step_s_replanned": later, "predicted_gain_s": gain_s,
                 "switch_cost_s": cost_s if cost_s != float("inf") else None, "step_s_moved": None if live is None else live.predicted_step_s,
                 "move_gain_s": live_gain_s, "move_cost_s": live_cost_s,
                 "switch": self.switch and mode is not None, "mode": mode if self.switch else None}
        self.found.append(found)
        if found["mode"] == "live":
            self.pending_live = live
        elif found["mode"] == "restart":
            self.pending = candidate
        return found
