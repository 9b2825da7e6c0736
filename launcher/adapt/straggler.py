"""Stragglers: a node that stays slower (or faster) than its calibrated speed, and a plan that fits
the speeds the cluster has now.

Calibration (launcher/adapt/calibration.py) gives each node's measured ÷ predicted compute. From
then on every step's measured compute per micro-batch is compared with that calibrated
expectation, relative to the nodes' typical ratio (their lower median): a machine that slows every
node alike is no straggler, and no plan would fix it (switching for it would only crowd the
cores). When one node's stays off by more than THRESHOLD (either way) for K steps in a row, its
new relative speed is the median of those K steps, an event `straggler` is written, the
replanner's corrected profile gets that speed (launcher/adapt/replanner.py), and two changes are
priced on it:

* a live move (launcher/adapt/live_moves.py): the same nodes at the same places, new cuts; it
  costs the predicted transfer of the moved layers plus one step held at the boundary, and
  happens within a step or two, in the running workers;
* a new plan from the planner: it may reorder or drop nodes, but switching to it restarts the
  stages at the next committed checkpoint (the cost: the slow steps until that checkpoint, this
  generation's start-up and two steps redone; events `rebalance`, then `restart`).

The one predicted to save more over the remaining steps, net of its cost, is taken, if it saves
anything at all and was not undone within its cool-down. Once it runs, it is checked on the
steps after it and undone when it did not pay (launcher/adapt/payoff.py); nothing is judged
while a change is pending, under way or being checked.
"""

from __future__ import annotations

import math
import statistics

from hetlaunch.launcher.adapt.calibration import boundary_transit, expected_transit
from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.adapt.payoff import Change, Review, Verdict
from hetlaunch.launcher.adapt.replanner import Replanner
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.profile_file import LinkProfile, Profile
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.launcher.run_record import StepRecord
from hetlaunch.runtime import host_clock

THRESHOLD = 1.5  # a node is off its calibrated speed when slower or faster than this factor
K = 5  # ... for this many steps in a row
# A link is slow mid-run only when its transits also exceed the profile's by this much. Calibration's
# 2 ms margin is too little here: on a loaded machine a receiver is woken a few ms late step after
# step, and a switch priced on that (as bandwidth: a fast link "carrying" a few Mbit/s) chose a lossy
# codec for an in-region link and changed the math for nothing.
WATCH_LINK_MARGIN_S = 0.010


class StragglerWatch:
    def __init__(self, train, replanner: Replanner, current: CurrentPlan, offsets=None):
        """`train`: the YAML's train section (its steps, `rebalance` and `checkpoint_every`);
        `offsets()`: each node's clock offset to the coordinator's (a transit spans two hosts)."""
        self.total_steps, self.replanner, self.current, self.offsets = train.steps, replanner, current, offsets
        self.switch = train.rebalance != "off"  # off: stragglers are only reported
        self.live = train.rebalance in ("auto", "live")
        # Without checkpoints there is nothing to restart from before the end: only a live move.
        self.checkpoint_every = train.checkpoint_every if train.rebalance in ("auto", "restart") else 0
        self.review = Review()
        self.pending: Change | None = None  # a change to make: move live now, or switch at the next checkpoint
        self.found: list[dict] = []  # every straggler seen, for events and the summary
        self._factors: dict[str, float] | None = None  # measured ÷ predicted compute of the plan's nodes; None: not watched
        self._off: dict[str, list[float]] = {}
        self._slow_links: dict[tuple[str, str], list[tuple[float, int]]] = {}
        self._taken: Change | None = None  # the change being made (a move under way, a switch)
        self._launched = host_clock.now()  # when this generation was launched (the clock of StepRecord.time)
        self._startup_s: float | None = None  # from its launch to its first step reported

    def calibrated(self, profile: Profile, factors: dict[str, float]) -> None:
        """Calibration measured the running plan: the replanner prices with its corrected profile,
        and the plan is watched against these factors."""
        self.replanner.calibrated(profile)
        self._factors, self._off = dict(factors), {}

    def new_generation(self, previous: Plan | None, first_step: int) -> None:
        """A generation is launched at `first_step`. A change this watch made (or took back) is
        watched against what it expects of its plan and checked; a plan after a lost node, not
        priced on the corrected profile, is not watched."""
        self._launched, self._startup_s = host_clock.now(), None
        self.review.new_generation(first_step)
        change, self._taken, self.pending = self._taken, None, None
        if change is not None and self.current.plan is change.target:
            self._factors, self._off = change.target_factors, {}
            self.review.landed(change, first_step)
        elif self.current.plan is not previous:
            self._factors, self._off = None, {}
            self.review.cancel()

    def take(self) -> Change:
        """The pending change, now being made."""
        self._taken, self.pending = self.pending, None
        return self._taken

    def joining(self, target: Plan, why: str, step: int) -> None:
        """A switch decided elsewhere (nodes joined) is being made: check it too once it runs.
        Its plan, priced on the measured profile, is not watched for stragglers."""
        factors = None if self._factors is None else dict(self._factors)
        self._taken, self.pending = Change("restart", self.current.plan, target, why, step, None, factors), None

    def moved(self, at_step: int) -> None:
        """The live move landed before `at_step`: its target runs now (the current plan)."""
        change, self._taken = self._taken, None
        self._factors, self._off, self._slow_links = change.target_factors, {}, {}
        self.review.landed(change, at_step)

    def move_cancelled(self) -> None:
        """The live move did not happen: the plan it would have left runs on and is watched again."""
        self._taken, self._off, self._slow_links = None, {}, {}

    def add(self, record: StepRecord) -> tuple[str, dict] | None:
        """Count a step; an event to write (a straggler found, a change checked), else None."""
        if self._startup_s is None:
            self._startup_s = max(0.0, record.time - self._launched)
        judged = self.review.add(record)
        if judged is not None:
            return self._judged(*judged, record.step)
        # Steps that run while a change is asked for, under way or being checked still show the
        # plan it leaves or the change itself: judged now, they would ask again for what is being done.
        if self._factors is None or self.pending is not None or self._taken is not None or self.review.checking:
            return None
        plan = self.current.plan
        shares = plan.pipeline_microbatches
        by_node = {s["node"]: s for s in record.stages}
        # A step record's compute names a node: each node's one stage is what it is measured against.
        stages = Topology.of(plan).by_node("the straggler watch (a stage's compute is reported by node)")
        ratios = {node: by_node[node]["compute_s"] / shares[q.pipeline] / (q.source.compute_s * self._factors[node])
                  for node, q in stages.items() if node in by_node and q.source.compute_s}
        # Against the nodes' typical ratio (the lower median: with two nodes, the less changed
        # one): a host (or a VM) that slows every node alike changes no node's share, and no plan
        # would fix it; a node that changed against the rest does.
        typical = statistics.median_low(ratios.values()) if len(ratios) > 1 else None
        for node, ratio in ratios.items():
            if typical is None or not (math.isfinite(ratio) and math.isfinite(typical) and ratio > 0 and typical > 0):
                continue  # a step with no compute measured (or nonsense) says nothing of a node's speed
            relative = ratio / typical
            off = self._off.setdefault(node, [])
            if relative > THRESHOLD or relative < 1 / THRESHOLD:
                off.append(relative)
            else:
                off.clear()
            if len(off) >= K:
                return "straggler", self._found(node, statistics.median(off), record.step)
        found = self._watch_links(record)
        return None if found is None else ("straggler", found)

    def _watch_links(self, record: StepRecord) -> dict | None:
        """Each boundary's forward link: the least transit of an activation this step, on one clock,
        against the corrected profile's latency + bytes / bandwidth (launcher/adapt/calibration.py)."""
        offsets = self.offsets() if self.offsets is not None else {}
        by_node = {s["node"]: s for s in record.stages}
        for stages in self.current.plan.pipelines():
            for up, down in zip(stages, stages[1:]):
                transit = boundary_transit(by_node, up.node, down.node, offsets)
                expected = None if transit is None else expected_transit(self.replanner.corrected, up.node,
                                                                         down.node, transit[1])
                if expected is None:
                    continue
                slow = self._slow_links.setdefault((up.node, down.node), [])
                if transit[0] > THRESHOLD * expected[0] and transit[0] - expected[0] > WATCH_LINK_MARGIN_S:
                    slow.append(transit)
                else:
                    slow.clear()
                if len(slow) >= K:
                    return self._found_link(up.node, down.node, expected[1], slow, record.step)
        return None

    def _found_link(self, a: str, b: str, link: LinkProfile, samples: list[tuple[float, int]], step: int) -> dict:
        """The link between a and b carries what its K slow transits say; plan again with that."""
        self._slow_links = {}
        bandwidth = self.replanner.link_carries(a, b, link, statistics.median(s for s, _ in samples),
                                                statistics.median(n for _, n in samples))
        mbps, profiled = bandwidth * 8 / 1e6, link.bandwidth_bytes_per_s * 8 / 1e6
        return self._decide(step, {"link": [a, b], "bandwidth_mbps": round(mbps, 3), "profiled_mbps": round(profiled, 3),
                                   "what": f"link {a} -> {b} carries {mbps:,.1f} Mbit/s (profiled {profiled:,.1f})"})

    def _found(self, node: str, ratio: float, step: int) -> dict:
        self._off = {}
        self._factors[node] *= ratio
        self.replanner.node_slower(node, ratio)
        return self._decide(step, {"node": node, "speed_vs_calibrated": round(1 / ratio, 4),
                                   "what": f"node {node} runs at {1 / ratio:.2f}x its calibrated speed"})

    def _decide(self, step: int, found: dict) -> dict:
        """Price the running plan, a live re-cut and a new plan on the corrected profile; take the
        change that gains the most net of its cost, if any and not undone within its cool-down."""
        plan, replanner = self.current.plan, self.replanner
        now = replanner.price(plan)
        left = self.total_steps - step - 1
        candidate, refused = replanner.rebalanced(), []
        if candidate is not None and self.review.refused(plan, candidate, step):
            candidate, refused = None, refused + ["restart"]
        later = None if candidate is None else candidate.predicted_step_s
        gain_s = left * (now - later) if now is not None and later is not None else 0.0
        # A restart waits for the next checkpoint at today's speed, starts a generation, redoes two steps.
        if self.checkpoint_every:
            to_checkpoint = (self.checkpoint_every - (step + 1) % self.checkpoint_every) % self.checkpoint_every
            cost_s = ((self._startup_s or 0.0) + 2 * (now or 0.0)
                      + to_checkpoint * max(0.0, (now or 0.0) - (later or 0.0)))
        else:
            cost_s = float("inf")
        live = replanner.recut(plan) if self.live and now is not None else None
        if live is not None and self.review.refused(plan, live, step):
            live, refused = None, refused + ["live"]
        live_gain_s = live_cost_s = 0.0
        if live is not None:
            live_gain_s = left * (now - live.predicted_step_s)
            live_cost_s = replanner.move_seconds(plan, live) + now  # the transfers, a step held
        mode = None
        if live is not None and live_gain_s - live_cost_s > max(0.0, gain_s - cost_s):
            mode = "live"
        elif gain_s > cost_s:
            mode = "restart"
        found = {**found, "step": step, "step_s_now": now, "step_s_replanned": later, "predicted_gain_s": gain_s,
                 "switch_cost_s": cost_s if cost_s != float("inf") else None,
                 "step_s_moved": None if live is None else live.predicted_step_s,
                 "move_gain_s": live_gain_s, "move_cost_s": live_cost_s,
                 "switch": self.switch and mode is not None, "mode": mode if self.switch else None,
                 **({"refused": refused} if refused else {})}
        if (failure := replanner.take_failure()) is not None:
            found["planner_error"] = failure
        self.found.append(found)
        if found["mode"] is not None:
            target = live if mode == "live" else candidate
            self.pending = Change(mode, plan, target, found["what"], step,
                                  dict.fromkeys(Topology.of(target).nodes, 1.0), dict(self._factors))
        return found

    def _judged(self, change: Change, verdict: Verdict, step: int) -> tuple[str, dict]:
        """A change checked: kept when it paid, else taken back (the same way it was made)."""
        figures = {"mode": change.mode, "why": change.why, "decided_at": change.step, "step": step,
                   "min_gain": self.review.min_gain, **verdict.figures()}
        if verdict.paid:
            return "rebalance_kept", figures
        until = self.review.refuse(change, step)
        if self.switch:
            self.pending = change.undone(f"{change.why}, but the change did not pay "
                                         f"({verdict.before_tokens_per_s:,.0f} tokens/s before, "
                                         f"{verdict.after_tokens_per_s:,.0f} after)", step)
        return "rebalance_undone", {**figures, "not_again_before_step": until}
