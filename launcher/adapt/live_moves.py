"""The coordinator's side of a live move: layers change stages between steps, in the running workers.

A live move keeps every node at its place in its pipeline (same ranks, same neighbours, same
micro-batch shares) and changes only where the cuts fall (planner.recut). It runs as three
messages to every stage of the generation (runtime/live_move.py has the stage's side):

1. HOLD: each stage answers the step it runs (or runs next), r, and begins no step after it;
2. GO: move before S = max(r) + 1 — every stage reaches S, none has passed it. With S at the
   end of the run there is nothing left to move for: CANCEL instead;
3. each stage reports the move done: its new range, the bytes it sent and received.

No checkpoint is read and no worker restarts. A stage that cannot take part (it finished, or
its worker is gone) answers the hold with an error, or not at all within HOLD_TIMEOUT_S: the
move is cancelled and the job trains on with its cut. A stage that fails during the move fails
the generation like any stage failure (the job restores the last checkpoint). Whether a move
paid is checked on the steps after it (launcher/adapt/payoff.py); one that did not is moved
back the same way.
"""

from __future__ import annotations

import time

from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.profile_file import Profile
from hetlaunch.launcher.planning.topology import Topology
from hetlaunch.launcher.stage_launch import data_parallel, layout_of, stage_spec
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.transfer_plan import transfers

HOLD_TIMEOUT_S = 30.0
MOVE_TIMEOUT_S = 600.0  # moving every layer of a large model over a WAN link; a dead peer fails the stage sooner
OPTIMIZER_COPIES = 3  # parameters + AdamW's two moments travel with a layer


def same_places(current: Plan, target: Plan) -> bool:
    """Whether `target` can be reached by a live move: every node at its place, the same shares."""
    return ([(s.node, s.pipeline) for s in current.stages] == [(s.node, s.pipeline) for s in target.stages]
            and current.pipeline_microbatches == target.pipeline_microbatches)


def move_seconds(profile: Profile, current: Plan, target: Plan) -> float:
    """The predicted time of the transfers: each moved layer's parameters and optimizer state over
    the measured link between its old and new holder, one after another (they are walked in order)."""
    at = Topology.of(current).placements  # a transfer names ranks: where they run
    total = 0.0
    for move in transfers(layout_of(current), layout_of(target)):
        link = profile.link(profile.node(at[move.src].node), profile.node(at[move.dst].node))
        total += OPTIMIZER_COPIES * profile.layers[move.layer].param_bytes / link.bandwidth_bytes_per_s + link.latency_s
    return total


class LiveMove:
    """One live move in progress; `poll` it with the move reports until it says how it ended."""

    def __init__(self, session, current: Plan, target: Plan, move_id: int, steps: int,
                 boundary_bytes: list[int] | None):
        self.session, self.current, self.target, self.id, self.steps = session, current, target, move_id, steps
        self.boundary_bytes = boundary_bytes
        # Hold and go answers name a node: one stage each.
        self.nodes = list(Topology.of(current).by_node("a live move (its answers name a node)"))
        self.held: dict[str, int] = {}
        self.moved: dict[str, pb.MoveReport] = {}
        self.at_step: int | None = None
        self.why_cancelled = ""
        self._since = time.monotonic()
        self._send_all(pb.Move(id=move_id, phase=pb.MOVE_PHASE_HOLD))

    def poll(self, reports: list[tuple[str, pb.MoveReport]]) -> str | None:
        """None while under way; "moved", "cancelled" (the job trains on with its cut) or "stuck"."""
        for node, report in reports:
            if report.id != self.id or node not in self.nodes:
                continue
            if not report.ok and self.at_step is None:
                return self._cancel(f"{node}: {report.error}")
            if report.phase == pb.MOVE_PHASE_HOLD:
                self.held[node] = report.step
            elif report.phase == pb.MOVE_PHASE_GO:
                self.moved[node] = report
        waited = time.monotonic() - self._since
        if self.at_step is None:
            if len(self.held) == len(self.nodes):
                return self._go()
            if waited > HOLD_TIMEOUT_S:
                silent = sorted(set(self.nodes) - set(self.held))
                return self._cancel(f"no answer to the hold from {', '.join(silent)} in {HOLD_TIMEOUT_S:.0f} s")
            return None
        if len(self.moved) == len(self.nodes):
            return "moved"
        return "stuck" if waited > MOVE_TIMEOUT_S else None

    def summary(self) -> dict:
        """For events.jsonl: where and what moved."""
        moved = self.moved.values()
        return {"id": self.id, "step": self.at_step,
                "ranges_before": [[s.node, s.layer_start, s.layer_end] for s in self.current.stages],
                "ranges_after": [[node, self.moved[node].layer_start, self.moved[node].layer_end]
                                 for node in self.nodes if node in self.moved],
                "bytes_moved": sum(r.bytes_sent for r in moved),
                "seconds": max((r.seconds for r in moved), default=0.0),
                "predicted_tokens_per_s": self.target.predicted_tokens_per_s}

    def _go(self) -> str | None:
        at_step = max(self.held.values()) + 1
        if at_step >= self.steps:
            return self._cancel(f"no step left to move before (the run ends at step {self.steps})")
        self.at_step, self._since = at_step, time.monotonic()
        topology = Topology.of(self.target)
        layout = layout_of(self.target)
        shared = data_parallel(self.session.cluster, self.target) if len(topology.pipelines) > 1 else None
        for placement in topology.placements:
            move = pb.Move(id=self.id, phase=pb.MOVE_PHASE_GO, at_step=at_step, layout=layout,
                           stage=stage_spec(self.session, topology, placement, self.boundary_bytes))
            if shared is not None:
                move.data_parallel.CopyFrom(shared)
            self.session.state.send(placement.node, pb.Command(move=move))
        return None

    def _cancel(self, why: str) -> str:
        self.why_cancelled = why
        self._send_all(pb.Move(id=self.id, phase=pb.MOVE_PHASE_CANCEL))
        return "cancelled"

    def _send_all(self, move: pb.Move) -> None:
        for node in self.nodes:
            self.session.state.send(node, pb.Command(move=move))
