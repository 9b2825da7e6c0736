"""runs/<id>/trace.json: what every stage did in sampled steps, beside what the plan predicted.

Stages record a timeline every `observe.trace_every` steps (runtime/executor.py): each
forward and backward, the waits for a message inside them, the drain of the sends, the
gradient sync and the optimizer step, in their host's wall clock. Each host's offset to the
coordinator's clock comes from its heartbeats (runtime/clock_offset.py), so the spans of
different hosts line up on one time axis.

The file is a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing): one
process per pipeline, named with its regions, one track per stage ("stage j: node
(region)"; where a node runs several stages, one per node: "node (region): stages 0, 3"), and for each pipeline a "predicted" process holding the schedule the planner
priced (runtime/schedules.py simulated_timeline on the plan's stage and link times), placed
at the start of the same step. The most recent MAX_STEPS sampled steps are kept, so the file
stays small on long runs; it is rewritten whole after every sampled step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hetlaunch.launcher.planning.device_plans import device_lists
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.launcher.run_record import write_run_file
from hetlaunch.launcher.session import JobError
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.registry import DEVICE_SCHEDULE_NAMES
from hetlaunch.runtime.schedules import B, E, F, I, W, schedule_for, simulated_timeline

MAX_STEPS = 8
PREDICTED_PID = 1000  # predicted pipeline p is process PREDICTED_PID + p
# What each kind of action is called in the trace (the executor's span names), and its one-letter label.
_KIND_NAMES = {F: "forward", B: "backward", I: "input gradient", W: "weight gradient", E: "eval forward"}
_LABELS = {name: kind.value for kind, name in _KIND_NAMES.items()}
_COMPUTE = {*_KIND_NAMES.values(), "optimizer"}


class Timeline:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "trace.json"
        self._steps: dict[int, dict[str, list[pb.TraceEvent]]] = {}  # step -> node -> its events, our clock
        self._plan: Plan | None = None
        self._where: dict[str, tuple[int, int]] = {}  # node -> (pipeline, stage index): its track
        self._origin: float | None = None  # the first event's time: the trace's zero
        self.offsets: dict[str, tuple[float, float | None]] = {}
        self.error: str | None = None  # why trace.json could not be written; then it no longer is  # node -> (clock offset, its round trip)

    def add(self, node: str, metrics: pb.StepMetrics, plan: Plan, clocks: dict[str, tuple[float, float]]) -> None:
        """One stage's timeline of one sampled step; written out once every stage of the plan sent it."""
        if self._plan is not plan:  # a new generation's plan: its stages are other tracks
            self._plan, self._steps, self._where = plan, {}, _tracks(plan)
        offset, round_trip = clocks.get(node, (0.0, None))  # not measured yet (no heartbeat answered): 0
        self.offsets[node] = (offset, round_trip)
        events = [pb.TraceEvent(name=e.name, start=e.start + offset, end=e.end + offset, microbatch=e.microbatch)
                  for e in metrics.trace]
        if self._origin is None and events:
            self._origin = min(e.start for e in events)
        self._steps.setdefault(metrics.step, {})[node] = events
        for old in sorted(self._steps)[:-MAX_STEPS]:
            del self._steps[old]
        # A report behind the 8 newest steps (a node's backlog, after `up` was stopped a while) is
        # dropped by that pruning at once: a KeyError here ended `up`.
        if len(self._steps.get(metrics.step, ())) == len(self._where):
            self.write()

    def write(self) -> None:
        """Rewrite trace.json whole. A trace is for looking, not for resuming: when it cannot be
        written (a full disk) the run goes on, says so once, and writes no more of it."""
        if self.error is not None:
            return
        try:
            write_run_file(self.path, json.dumps(self.chrome_trace()) + "\n")
        except JobError as err:
            self.error = str(err)
            print(f"warning: {err}; trace.json is no longer updated", file=sys.stderr, flush=True)

    def chrome_trace(self) -> dict:
        plan, origin = self._plan, self._origin or 0.0
        events: list[dict] = []
        if plan is None:
            return {"traceEvents": events}
        pipelines = plan.pipelines()
        for p, stages in enumerate(pipelines):
            regions = " → ".join(dict.fromkeys(s.region for s in stages))
            for pid, label in ((p, f"pipeline {p} ({regions})"), (PREDICTED_PID + p, f"pipeline {p} predicted")):
                events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
                events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
                for j, name in enumerate(_track_names(plan, stages)):
                    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": j, "args": {"name": name}})
        where = self._where
        for step, by_node in sorted(self._steps.items()):
            for node, spans in by_node.items():
                if node not in where:
                    continue
                p, j = where[node]
                for e in spans:
                    events.append(_span(e.name, e.start - origin, e.end - origin, p, j, step, e.microbatch))
            starts = {}
            for node, spans in by_node.items():
                if node in where and spans:
                    p = where[node][0]
                    starts[p] = min(starts.get(p, float("inf")), min(e.start for e in spans))
            for p, start in starts.items():
                events += _predicted(plan, pipelines[p], plan.pipeline_microbatches[p], p, step, start - origin)
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"clocks": {n: {"offset_ms": o * 1e3, "round_trip_ms": None if rtt is None else rtt * 1e3}
                                         for n, (o, rtt) in sorted(self.offsets.items())},
                              "sampled_steps": sorted(self._steps)}}


def _tracks(plan: Plan) -> dict[str, tuple[int, int]]:
    """node -> (pipeline, track): a stage's trace events name its node. One track per stage, or,
    where a node runs several stages (interleaved 1F1B, ZB-V; a node serves one pipeline), one per
    node, in its pipeline's order of nodes: its one worker's actions, whichever stage they are of."""
    if _by_device(plan):
        return {node: (p, d) for p, stages in enumerate(Topology.of(plan).pipelines)
                for d, node in enumerate(dict.fromkeys(q.node for q in stages))}
    return {node: (q.pipeline, q.stage)
            for node, q in Topology.of(plan).by_node("trace.json (a stage's events name its node)").items()}


def _by_device(plan: Plan) -> bool:
    return plan.schedule in DEVICE_SCHEDULE_NAMES


def _track_names(plan: Plan, stages) -> list[str]:
    if not _by_device(plan):
        return [f"stage {j}: {s.node} ({s.region})" for j, s in enumerate(stages)]
    nodes = list(dict.fromkeys(s.node for s in stages))
    region = {s.node: s.region for s in stages}
    held = {n: ", ".join(str(j) for j, s in enumerate(stages) if s.node == n) for n in nodes}
    return [f"{n} ({region[n]}): stages {held[n]}" for n in nodes]


def _span(name: str, start: float, end: float, pid: int, tid: int, step: int, microbatch: int) -> dict:
    label = f"{_LABELS[name]}{microbatch}" if name in _LABELS else name
    args = {"step": step, **({"microbatch": microbatch} if microbatch >= 0 else {})}
    return {"name": label, "cat": "compute" if name in _COMPUTE else "communication", "ph": "X",
            "ts": round(start * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
            "pid": pid, "tid": tid, "args": args}


def _predicted(plan: Plan, stages, microbatches: int, p: int, step: int, start: float) -> list[dict]:
    """The pipeline's step as the planner priced it (each stage's forward, backward and, split, its
    I and W per micro-batch, as simulated; a plan from before they were kept: forward a third and
    backward two thirds of the stage's time), from `start`; nothing for a plan not priced from a
    profile."""
    if any(s.compute_s is None for s in stages):
        return []
    S = len(stages)
    if _by_device(plan):  # one list per node, as the worker runs it; boundaries inside a node are free
        per_track = device_lists(plan.schedule, len({s.node for s in stages}), microbatches, stages[0].device_order,
                                 stages)
    else:
        per_track = [schedule_for(plan.schedule, j, S, microbatches, s.window) for j, s in enumerate(stages)]
    forward, backward = zip(*(s.forward_backward_s() for s in stages))
    split = [s.split_s() for s in stages]
    split = list(zip(*split)) if all(split) else (None, None)  # as cost_model.split_costs
    timeline = simulated_timeline(per_track, list(forward), list(backward), [s.link_s or 0.0 for s in stages[:-1]],
                                  [s.latency_s or 0.0 for s in stages[:-1]], *(list(c) if c else None for c in split))
    return [_span(_KIND_NAMES[a.kind], start + t0, start + t1, PREDICTED_PID + p, j, step, a.microbatch)
            for j, actions in enumerate(timeline) for a, t0, t1 in actions]
