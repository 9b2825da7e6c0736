"""Calibration: the plan checked against what training measures, and the profile corrected.

A plan is made from a profile that timed each node alone, one layer at a time. Training then
runs every stage at once (agents sharing a host share its cores, as GPUs on one host share
its CPU and PCIe), through the whole stack (autograd across layers, the loss, data, sends).
After the first step of a generation (warm-up) the next CALIBRATION_STEPS steps are compared
with the plan:

* per node, a speed correction: its stage's measured compute per micro-batch (the median
  over those steps of the compute it reported, divided by its pipeline's micro-batches) ÷
  the compute per micro-batch the plan predicted. The calibrated profile has each node's
  layer and optimizer times multiplied by it;
* the running plan priced again on the calibrated profile (the same cut, micro-batches and
  codecs allowed; launcher/planning/planner.py price_pipelines), and what is still unexplained: the
  median measured step minus that prediction, the time a step spends outside what the cost
  model counts (the stage's Python around its kernels, data, the control plane). It is
  reported, and added to the calibrated prediction, which then predicts the steps after
  the calibration window.

* per stage boundary, a link correction: every stage reports the least transit of an activation
  it received in a step (its arrival on the receiver's clock minus its sending on the sender's,
  shifted onto the coordinator's clock with both hosts' offsets): a message the receiver was
  waiting for arrives when the link delivers it, so the least one is the link's own time. Its
  median ÷ the profile's latency + bytes / bandwidth is reported per link; where they differ by
  more than LINK_TOLERANCE and LINK_MARGIN_S, the calibrated profile gets that link's bandwidth
  as measured (a node-pair link entry).

Written to runs/<id>/calibration.json and runs/<id>/profile-calibrated.json (which `hetlaunch
plan --profile` reads), and summarised in summary.json under "calibration".
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.planner import PlanningError, price_pipelines
from hetlaunch.launcher.planning.profile_edits import scaled
from hetlaunch.launcher.planning.profile_file import LinkProfile, Profile, ProfileError, save_profile
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.launcher.run_record import StepRecord, write_run_file

CALIBRATION_STEPS = 8  # steps compared with the plan, after a generation's first (their median: noise)
LINK_TOLERANCE = 1.2  # a link's measured transit is corrected when off by more than this factor...
LINK_MARGIN_S = 0.002  # ... and this much: fast links' transits are fractions of a millisecond, mostly noise


def boundary_transit(stages: dict[str, dict], up: str, down: str,
                     offsets: dict[str, tuple[float, float | None]]) -> tuple[float, int] | None:
    """The step's least transit of an activation from `up` to `down` (seconds on one clock, wire bytes)."""
    transit = stages.get(down, {}).get("transit", {}).get("from_prev")
    if transit is None:
        return None
    return transit[0] + offsets.get(down, (0.0,))[0] - offsets.get(up, (0.0,))[0], transit[1]


def expected_transit(profile: Profile, up: str, down: str, wire_bytes: float) -> tuple[float, LinkProfile] | None:
    """What the profile predicts for that message, and the link it used; None where it has no link."""
    try:
        link = profile.link(profile.node(up), profile.node(down))
    except (StopIteration, ProfileError):
        return None
    return link.latency_s + wire_bytes / link.bandwidth_bytes_per_s, link


def with_link(profile: Profile, up: str, down: str, link: LinkProfile, seconds: float, wire_bytes: float) -> Profile:
    """`profile` with the link between up and down carrying `wire_bytes` in `seconds` past its latency."""
    bandwidth = wire_bytes / max(seconds - link.latency_s, 1e-6)
    others = [l for l in profile.links if not (l.nodes is not None and set(l.nodes) == {up, down})]
    return profile.model_copy(update={"links": [
        LinkProfile(nodes=(up, down), bandwidth_bytes_per_s=bandwidth, latency_s=link.latency_s)] + others})


class Calibration:
    def __init__(self, run_dir: Path, current: CurrentPlan, offsets=None):
        """`current`: the plan running; `offsets()`: each node's clock offset to the coordinator's
        (None: all on one clock)."""
        self.run_dir = run_dir
        self.current = current
        self.offsets = offsets
        self.result: dict | None = None
        self.profile: Profile | None = None  # the corrected profile, once calibrated
        self._profile: Profile | None = None
        self._records: list[StepRecord] = []
        # The first step that ran another plan than the calibrated one (a recovery, a restart or a
        # live move after the calibration): finish compares the predictions with the steps before it.
        self._plan_until: int | None = None

    def new_generation(self, profile: Profile | None, first_step: int = 0) -> None:
        """A generation starts at `first_step` with the current plan, made from `profile`; its first
        step is warm-up. A plan not priced from a profile (pinned, nothing measured) is not calibrated."""
        self._profile, self._records = profile, []
        self.plan_changed(first_step)

    def plan_changed(self, at_step: int) -> None:
        """Steps from `at_step` on ran another plan than the one calibrated (if any was)."""
        if self.result is not None and self._plan_until is None:
            self._plan_until = at_step

    def add(self, record: StepRecord) -> dict | None:
        """Count a step; the calibration, once, when CALIBRATION_STEPS steps after the warm-up are in."""
        if self.result is not None or self._profile is None or self.current.plan.predicted_step_s is None:
            return None
        self._records.append(record)
        if len(self._records) < 1 + CALIBRATION_STEPS:
            return None
        try:
            self.result = self._calibrate(self._records[1:])
        except (PlanningError, ProfileError) as err:  # e.g. a calibrated stage no longer fits its memory
            self.result = {"error": str(err)}
        write_run_file(self.run_dir / "calibration.json", json.dumps(self.result, indent=2) + "\n")
        return self.result

    def _calibrate(self, records: list[StepRecord]) -> dict:
        plan, profile = self.current.plan, self._profile
        shares = plan.pipeline_microbatches
        factors = {}
        # A node's speed factor is its stage's measured ÷ predicted compute: the records name nodes.
        for node, q in Topology.of(plan).by_node("calibration (a stage's compute is reported by node)").items():
            measured = statistics.median(s["compute_s"] for r in records for s in r.stages if s["node"] == node)
            factors[node] = measured / shares[q.pipeline] / q.source.compute_s
        pinned = [([s.node for s in stages], [(s.layer_start, s.layer_end) for s in stages], share)
                  for stages, share in zip(plan.pipelines(), shares)]
        compute_only = scaled(profile, factors)
        calibrated, link_factors, corrected = self._links(compute_only, plan, records)
        repriced = price_pipelines(calibrated, pinned, plan.schedule, plan.compression)
        # The same with the links as profiled: what the links' correction alone explains.
        compute_repriced = repriced if not corrected else price_pipelines(compute_only, pinned, plan.schedule,
                                                                          plan.compression)
        measured_step = statistics.median(r.step_s for r in records)
        save_profile(calibrated, self.run_dir / "profile-calibrated.json")
        self.profile = calibrated
        return {
            "steps": [records[0].step, records[-1].step],
            "node_speed_factors": {n: round(f, 4) for n, f in factors.items()},  # measured ÷ predicted compute
            "link_transit_factors": link_factors,  # measured ÷ predicted least transit per boundary
            "links_corrected": corrected,  # Mbit/s now in the calibrated profile
            "predicted_step_s": plan.predicted_step_s,
            "calibrated_step_s": repriced.step_s,  # the same plan on the calibrated profile
            "compute_calibrated_step_s": compute_repriced.step_s,  # ... with only the nodes' speeds calibrated
            "unexplained_step_s": measured_step - repriced.step_s,  # outside the cost model
            "measured_step_s": measured_step,
        }

    def _links(self, profile: Profile, plan: Plan, records: list[StepRecord]) -> tuple[Profile, dict, dict]:
        offsets = self.offsets() if self.offsets is not None else {}
        factors, corrected = {}, {}
        for stages in plan.pipelines():
            for up, down in zip(stages, stages[1:]):
                samples = [t for r in records if (t := boundary_transit({s["node"]: s for s in r.stages},
                                                                         up.node, down.node, offsets))]
                if not samples:
                    continue
                seconds = statistics.median(s for s, _ in samples)
                wire_bytes = statistics.median(n for _, n in samples)
                expected = expected_transit(profile, up.node, down.node, wire_bytes)
                if expected is None:
                    continue
                factors[f"{up.node}->{down.node}"] = round(seconds / expected[0], 4)
                if (abs(seconds - expected[0]) > LINK_MARGIN_S
                        and not 1 / LINK_TOLERANCE <= seconds / expected[0] <= LINK_TOLERANCE):
                    profile = with_link(profile, up.node, down.node, expected[1], seconds, wire_bytes)
                    corrected[f"{up.node}->{down.node}"] = round(profile.links[0].bandwidth_bytes_per_s * 8 / 1e6, 3)
        return profile, factors, corrected

    def finish(self, records: list[StepRecord]) -> dict | None:
        """At the end of the run: both predictions against the steps after the calibration window
        (the median step), written to calibration.json; the result for the summary."""
        if self.result is None or "error" in self.result:
            return self.result
        until = self._plan_until if self._plan_until is not None else math.inf
        later = [r.step_s for r in records if self.result["steps"][1] < r.step < until]
        if later:
            measured = statistics.median(later)
            after = self.result["calibrated_step_s"] + self.result["unexplained_step_s"]
            self.result["after_window"] = {
                "steps": len(later), "measured_step_s": measured,
                **({"plan_changed_at_step": self._plan_until} if self._plan_until is not None else {}),
                "error_before": (self.result["predicted_step_s"] - measured) / measured,
                "error_calibrated_compute": (self.result["calibrated_step_s"] - measured) / measured,
                "error_calibrated": (after - measured) / measured}
            write_run_file(self.run_dir / "calibration.json", json.dumps(self.result, indent=2) + "\n")
        return self.result
