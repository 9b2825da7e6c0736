"""The job's planner while it runs: one object every change of plan asks.

It owns what plans are made from: the profile as measured, the same profile corrected by what
training has measured since (calibration's factors, stragglers, slow links), the codecs the
YAML allows, and which nodes are live. It answers:

* plan: the planner's plan for some nodes (the first plan; a re-plan after a lost node), or a
  pinned cut priced;
* price: the step a plan (its cuts, shares and codecs) takes on the corrected profile;
* re-cut: the best cuts of a running plan's own pipelines (what a live move can reach);
* re-plan: the planner's plan for the live nodes on the corrected profile (a rebalance);
* join: the plan with (re)joined nodes, when it is predicted enough faster.

Re-plans after a lost node and joins plan from the measured profile, rebalancing from the
corrected one (stragglers are found and priced against it).

Rebalancing is optional: the job trains on without it. So an error of the planner there — a bug,
a profile it cannot price — never ends the job: the answer is "no change", and the error is kept
(`failure`) for the watch to report once, while the running plan goes on.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import replace
from typing import Callable

from hetlaunch.launcher.adapt.live_moves import move_seconds, same_places
from hetlaunch.launcher.adapt.calibration import with_link
from hetlaunch.launcher.device_schedule_checks import auto_refusal
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.planning.batch_sizes import at_size
from hetlaunch.launcher.planning.island_plans import merge, plan_islands, price_outer, with_outer_memory
from hetlaunch.launcher.planning.plan import Plan, planned
from hetlaunch.launcher.planning.planner import (PlannerResult, PlanningError, fits_memory, plan_fixed_cut,
                                                price_pipelines, recut)
from hetlaunch.launcher.planning.profile_edits import scaled, subset
from hetlaunch.launcher.planning.profile_file import LinkProfile, Profile, ProfileError, with_encryption
from hetlaunch.launcher.planning.request import PlanRequest, plan_for
from hetlaunch.runtime.registry import AUTO_SCHEDULE, AUTO_SCHEDULES, DEVICE_SCHEDULE_NAMES

JOIN_GAIN = 0.10  # a (re)joined node is taken in when the planner predicts at least this much more tokens/s


class Replanner:
    def __init__(self, cluster, measured: Profile | None, live_nodes: Callable[[], list[str]]):
        """`measured`: the profile the job measured (None: a pinned plan with nothing measured);
        `live_nodes()`: the YAML's nodes that are joined and not lost, in YAML order."""
        self.cluster = cluster
        self.request = request_for(cluster)
        self._fallbacks: tuple[str, ...] = ()  # schedules a re-plan tries where the request's fits no plan
        self.measured = measured
        self.corrected: Profile | None = None  # once calibrated: what rebalancing prices with
        self._live_nodes = live_nodes
        self.failure: str | None = None  # the first planner error while rebalancing, until reported
        self._failed_before = False

    @property
    def compression(self):
        return self.request.compression

    @property
    def measured(self) -> Profile | None:
        return self._measured

    @measured.setter
    def measured(self, profile: Profile | None) -> None:
        """The job's profile, told what data_plane.encrypt seals, so every plan prices its cipher."""
        self._measured = None if profile is None else with_encryption(profile, self.cluster.data_plane.encrypt)

    def live_nodes(self) -> list[str]:
        return self._live_nodes()

    # --- plans from the measured profile ------------------------------------------------------

    def first(self) -> tuple[Plan, PlannerResult]:
        """The job's first plan, over every measured node (PlanningError as the planner words it),
        and the planner's result it came from."""
        if self.cluster.train.outer is not None:  # the islands' plan; the result says how long planning took
            started = time.perf_counter()
            plan = plan_islands(self.cluster, self.measured, self.request)
            return plan, PlannerResult(pipelines=[], step_s=plan.predicted_step_s or 0.0,
                                       tokens_per_s=plan.predicted_tokens_per_s or 0.0, method="islands",
                                       planning_s=time.perf_counter() - started)
        result = plan_for(self.measured, self.request)
        self.request, self._fallbacks = kept_family(self.request, result.schedule, len(result.pipelines))
        return planned(self.cluster, result), result

    def _planned(self, profile: Profile, source: str) -> Plan:
        """The planner's plan on `profile` (islands where the YAML asks for them)."""
        if self.cluster.train.outer is not None:
            return plan_islands(self.cluster, profile, self.request, source=source)
        try:
            return planned(self.cluster, plan_for(profile, self.request), source=source)
        except PlanningError as err:
            for schedule in self._fallbacks:
                try:
                    return planned(self.cluster, plan_for(profile, replace(self.request, schedule=schedule)),
                                   source=source)
                except PlanningError:
                    continue
            raise err from None

    def plan(self, names: list[str], source: str = "replanned") -> Plan:
        """The planner's plan for `names` on the measured profile; JobError if none fits."""
        try:
            return self._planned(subset(self.measured, names), source)
        except PlanningError as err:
            raise JobError(f"the nodes left ({', '.join(names)}) cannot train the model: {err}") from None

    def replan(self) -> Plan:
        """A plan for the nodes still in the job (pinned layers cannot survive a lost node)."""
        names = self.live_nodes()
        if not names:
            raise JobError("no node is left to train on")
        return self.plan(names)

    def priced_pins(self, pinned: Plan) -> Plan:
        """A pinned cut priced on the measured profile, its codecs chosen where left to `auto`."""
        chains = [([s.node for s in stages], [(s.layer_start, s.layer_end) for s in stages])
                  for stages in pinned.pipelines()]
        at = at_size(self.measured, pinned.micro_batch_size)
        candidates = self._pinned_schedules(pinned)
        schedule = candidates[0]
        if pinned.islands:  # each island priced alone (its sync stays inside it), then the outer exchange
            at = with_outer_memory(at, self.cluster.train.outer, len(pinned.island_members()))
            plans = [planned(self.cluster, price_pipelines(at, [(*chains[p], pinned.pipeline_microbatches[p])
                                                                for p in members], schedule, self.compression),
                             source="pinned")
                     for members in pinned.island_members()]
            return price_outer(self.cluster, at, merge(plans, {}))
        # 1F1B windows the YAML pinned: priced as they will run (the candidates are 1F1B alone then)
        windows = [tuple(s.window for s in stages) for stages in pinned.pipelines()]
        results = []
        for schedule in candidates:
            if len(chains) == 1:
                result = plan_fixed_cut(at, *chains[0], pinned.num_microbatches, schedule, self.compression,
                                        windows=windows[0])
            else:
                result = price_pipelines(at, [(nodes, cuts, share) for (nodes, cuts), share
                                              in zip(chains, pinned.pipeline_microbatches)], schedule, self.compression,
                                         windows=windows)
            if fits_memory(result) or schedule == candidates[0]:
                results.append(result)
        best = max(results, key=lambda r: r.tokens_per_s)  # the first (1F1B) on a tie
        if len(candidates) > 1:
            priced = ", ".join(f"{r.schedule} {r.tokens_per_s:,.0f}" for r in results)
            best = replace(best, schedule_choice=f"auto: the pinned cut priced tokens/s {priced}")
        return planned(self.cluster, best, source="pinned")

    def _pinned_schedules(self, pinned: Plan) -> tuple[str, ...]:
        """The schedules a pinned cut is priced under: the YAML's, or with `auto` each candidate
        (1F1B alone where windows are pinned or islands are planned: windows are 1F1B's, and
        islands keep one schedule for every pipeline)."""
        schedule = self.cluster.train.schedule
        if schedule != AUTO_SCHEDULE:
            return (schedule,)
        if pinned.islands or any(s.window for s in pinned.stages):
            return AUTO_SCHEDULES[:1]
        return AUTO_SCHEDULES

    def join(self, current: Plan) -> Plan | None:
        """The plan with the (re)joined nodes, if the planner predicts it JOIN_GAIN faster than `current`."""
        if self.measured is None or current.predicted_tokens_per_s is None:
            return None  # nothing measured to predict with (a pinned plan)
        names = [n for n in self.live_nodes() if any(p.name == n for p in self.measured.nodes)]
        try:
            candidate = self.plan(names)
        except JobError:
            return None
        except Exception as err:
            self._unexpected("planning with the joined nodes", err)
            return None
        gain = (candidate.predicted_tokens_per_s or 0) / current.predicted_tokens_per_s - 1
        return candidate if gain >= JOIN_GAIN else None

    # --- what training measured -------------------------------------------------------------

    def calibrated(self, profile: Profile) -> None:
        """Calibration's corrected profile: rebalancing prices with it from now on."""
        self.corrected = profile

    def node_slower(self, node: str, factor: float) -> None:
        """`node` computes `factor` times as long as the corrected profile says."""
        self.corrected = scaled(self.corrected, {node: factor})

    def link_carries(self, up: str, down: str, link: LinkProfile, seconds: float, wire_bytes: float) -> float:
        """The link between up and down carries `wire_bytes` in `seconds` past its latency; the
        bandwidth that gives (bytes/s), now in the corrected profile."""
        self.corrected = with_link(self.corrected, up, down, link, seconds, wire_bytes)
        return self.corrected.links[0].bandwidth_bytes_per_s

    # --- rebalancing, on the corrected profile ------------------------------------------------

    def _unexpected(self, what: str, err: Exception) -> None:
        """A planner error while rebalancing: kept to be reported once; the answer is no change."""
        if not self._failed_before:
            where = traceback.extract_tb(err.__traceback__)[-1]
            self.failure = (f"the planner failed while {what} ({type(err).__name__}: {' '.join(str(err).split())} "
                            f"at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}); the running plan goes on")
            self._failed_before = True

    def take_failure(self) -> str | None:
        """The planner error to report (once), if one happened since the last call."""
        failure, self.failure = self.failure, None
        return failure

    def price(self, plan: Plan) -> float | None:
        """The step `plan` (its cuts, shares and codecs) is predicted to take; None if it cannot run."""
        try:
            if plan.islands:
                return price_outer(self.cluster, self.corrected, _repriced_islands(self, plan),
                                   every=plan.outer.every).predicted_step_s
            return price_pipelines(self.corrected, _chains(plan), plan.schedule, plan.compression).step_s
        except (PlanningError, ProfileError):
            return None
        except Exception as err:  # a planner bug must not end a job that trains fine without this answer
            self._unexpected("pricing the running plan", err)
            return None

    def rebalanced(self) -> Plan | None:
        """The planner's plan for the live nodes, or None if none fits."""
        names = self.live_nodes()
        try:
            return self._planned(subset(self.corrected, names), "replanned")
        except PlanningError:
            return None
        except Exception as err:
            self._unexpected("re-planning on the corrected profile", err)
            return None

    def recut(self, current: Plan) -> Plan | None:
        """The best cuts of `current`'s own pipelines (what a live move can reach), with
        `current`'s windows: a move keeps each stage's schedule. None if it changes nothing or fits nowhere."""
        try:
            return self._recut(current)
        except Exception as err:
            self._unexpected("re-cutting the running pipelines", err)
            return None

    def _recut(self, current: Plan) -> Plan | None:
        if current.islands:
            return None  # live moves keep to plans without islands (a move's peers span one pipeline set)
        profile = self.corrected
        try:
            if profile.micro_batch_size != current.micro_batch_size:  # planned at a global batch's size
                profile = at_size(profile, current.micro_batch_size)
            result = recut(profile, [([s.node for s in stages], share)
                                     for stages, share in zip(current.pipelines(), current.pipeline_microbatches)],
                           current.schedule, current.compression)
        except (PlanningError, ProfileError):
            return None
        if not math.isfinite(result.step_s):  # a profile the planner cannot price (a NaN time): a bug, reported
            raise ValueError(f"the planner priced a re-cut step of {result.step_s}")
        target = planned(self.cluster, result, source="live move")
        target = replace(target, stages=tuple(replace(s, window=c.window) for s, c in zip(target.stages, current.stages)))
        if not same_places(current, target) or _cut(target) == _cut(current):
            return None
        return target

    def move_seconds(self, current: Plan, target: Plan) -> float:
        """The predicted time of a live move's transfers from `current` to `target`."""
        return move_seconds(self.corrected, current, target)


def request_for(cluster) -> PlanRequest:
    """The plan request of a whole cluster YAML: its train section and codecs, and whether the rest
    of it (nodes, islands, rebalance) lets `auto` choose a device schedule."""
    return PlanRequest.for_train(cluster.train, cluster.compression, auto_refusal(cluster))


def kept_family(request: PlanRequest, schedule: str, pipelines: int = 1) -> tuple[PlanRequest, tuple[str, ...]]:
    """The request every later plan of a job is made with, once its first plan runs `schedule`,
    and the schedules to try in turn where that request fits no plan.

    A re-plan (after a lost node, a join) keeps the family the job started in: with `auto`, one
    that started on several stages per node re-plans that same schedule on as many pipelines at most
    as its first plan had (`pipelines`; the YAML's max_pipelines where it gives a number), and one
    that started on one stage per node no longer considers the device schedules. Either switch
    would change under a running job what its YAML left to the default: a device schedule turns
    rebalancing off (the straggler watch is not fed), and a plan switched back to one stage per node
    would turn it on again mid-run; and a rebalance's re-plan is priced and taken as a move or a
    restart of one stage per node (launcher/adapt/straggler.py), which a device plan is not.
    Where the nodes left cannot run the device schedule (interleaved 1F1B needs the micro-batches in
    rounds of its nodes, and leaves out those past the most that divide them, two at least:
    launcher/planning/device_plans.py), the other one is tried: a checkpoint is per layer, so any
    cut resumes it."""
    if request.schedule != AUTO_SCHEDULE:
        return request, ()
    if schedule in DEVICE_SCHEDULE_NAMES:
        return (replace(request, schedule=schedule, max_pipelines=request.max_pipelines or pipelines),
                tuple(s for s in DEVICE_SCHEDULE_NAMES if s != schedule))
    return replace(request, device_schedules_refused="the job runs one stage per node"), ()


def _repriced_islands(replanner: Replanner, plan: Plan) -> Plan:
    """`plan`'s islands, each priced alone on the corrected profile, merged (outer steps unpriced)."""
    chains = _chains(plan)
    profile = with_outer_memory(replanner.corrected, replanner.cluster.train.outer, len(plan.island_members()))
    return merge([planned(replanner.cluster, price_pipelines(profile, [chains[p] for p in members],
                                                             plan.schedule, plan.compression), source=plan.source)
                  for members in plan.island_members()], {})


def _chains(plan: Plan) -> list[tuple[list[str], list[tuple[int, int]], int]]:
    return [([s.node for s in stages], [(s.layer_start, s.layer_end) for s in stages], share)
            for stages, share in zip(plan.pipelines(), plan.pipeline_microbatches)]


def _cut(plan: Plan) -> list[tuple]:
    return [(s.layer_start, s.layer_end, s.forward_codec, s.backward_codec) for s in plan.stages]
