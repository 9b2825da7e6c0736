"""The live move's protocol without a cluster: the stage's gate (hold, go, cancel at step
boundaries), the coordinator's choice of the step to move before, its cancellations, and a
layer header from another host that is not what a move sends."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from torch import nn

from hetlaunch.launcher.adapt.live_moves import LiveMove, same_places
from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint import stage_state
from hetlaunch.runtime.layer_transfer import _parse_header, most_state_bytes
from hetlaunch.runtime.model import build_layer, describe_model
from hetlaunch.runtime.model_spec import ModelSpec, preset
from hetlaunch.runtime.transfer_plan import TransferError
from hetlaunch.runtime.stage_move import MoveGate

HOLD, GO, CANCEL = pb.MOVE_PHASE_HOLD, pb.MOVE_PHASE_GO, pb.MOVE_PHASE_CANCEL


def _gate(step: int = 0):
    answers: list[pb.MoveReport] = []
    return MoveGate(answers.append, step), answers


def _in_thread(fn, *args):
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as err:  # handed to the test
            out["error"] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_held_stage_finishes_its_step_then_waits_until_go_and_moves_at_its_step():
    gate, answers = _gate()
    assert gate.before_step(5) is None  # running step 5
    gate.control(pb.Move(id=1, phase=HOLD))
    assert answers[-1].phase == HOLD and answers[-1].step == 5 and answers[-1].ok
    thread, out = _in_thread(gate.before_step, 6)  # step 5 ends; step 6 waits
    time.sleep(0.2)
    assert thread.is_alive() and not out
    gate.control(pb.Move(id=1, phase=GO, at_step=7))  # another stage was running 6: S = 7
    thread.join(5)
    assert out == {"value": None}
    move = gate.before_step(7)
    assert move is not None and move.at_step == 7 and gate.before_step(8) is None


def test_cancel_releases_a_held_stage_and_nothing_moves():
    gate, _ = _gate(3)
    gate.control(pb.Move(id=2, phase=HOLD))
    thread, out = _in_thread(gate.before_step, 4)
    time.sleep(0.1)
    assert thread.is_alive()
    gate.control(pb.Move(id=2, phase=CANCEL))
    thread.join(5)
    assert out == {"value": None} and gate.before_step(5) is None


def test_a_go_for_a_step_already_begun_fails_the_stage_instead_of_moving_late():
    gate, _ = _gate()
    gate.before_step(10)
    gate.control(pb.Move(id=3, phase=GO, at_step=9))
    with pytest.raises(RuntimeError, match="before step 9, but step 11 is running"):
        gate.before_step(11)


def test_a_finished_stage_answers_the_step_count():
    gate, answers = _gate()
    gate.before_step(19)
    gate.finished(20)
    gate.control(pb.Move(id=4, phase=HOLD))
    assert answers[-1].step == 20


class _State:
    def __init__(self):
        self.sent: list[tuple[str, pb.Command]] = []

    def send(self, node: str, command: pb.Command) -> None:
        self.sent.append((node, command))


class _Session:
    def __init__(self):
        self.state = _State()
        self.cluster = None

    def device_of(self, node: str) -> str:
        return "cpu"

    def threads_of(self, node: str) -> int:
        return 1


def _plan(cuts: list[tuple[str, int, int]]) -> Plan:
    return Plan(stages=tuple(StagePlan(node, "r", a, b) for node, a, b in cuts), num_layers=cuts[-1][2],
                micro_batch_size=1, num_microbatches=4, schedule="1f1b", source="planned")


def _held(move: LiveMove, steps: dict[str, int], ok: bool = True) -> str | None:
    return move.poll([(node, pb.MoveReport(id=move.id, phase=HOLD, step=s, ok=ok, error="" if ok else "gone"))
                      for node, s in steps.items()])


def test_the_coordinator_cancels_when_no_step_is_left_or_a_stage_cannot_hold():
    current, target = _plan([("a", 0, 2), ("b", 2, 4)]), _plan([("a", 0, 3), ("b", 3, 4)])
    assert same_places(current, target) and not same_places(current, _plan([("b", 0, 2), ("a", 2, 4)]))
    session = _Session()
    move = LiveMove(session, current, target, 1, steps=10, boundary_bytes=None)
    assert [c.move.phase for _, c in session.state.sent] == [HOLD, HOLD]
    assert _held(move, {"a": 9}) is None
    assert _held(move, {"b": 8}) == "cancelled" and "no step left" in move.why_cancelled
    assert session.state.sent[-1][1].move.phase == CANCEL
    move = LiveMove(session, current, target, 2, steps=10, boundary_bytes=None)
    assert _held(move, {"a": 3}, ok=False) == "cancelled" and "a: gone" in move.why_cancelled
    stale = LiveMove(session, current, target, 3, steps=10, boundary_bytes=None)
    assert stale.poll([("a", pb.MoveReport(id=99, phase=HOLD, step=1, ok=True))]) is None and not stale.held


@pytest.mark.parametrize("header, message", [
    (b"\xff\x00", "not JSON"),
    (json.dumps({"a": 1}).encode(), "not a list"),
    (json.dumps([["layers.3.w", "float32", [2]]]).encode(), "is not of layer 4"),
    (json.dumps([["layers.4.w", "object", [2]]]).encode(), "malformed"),
    (json.dumps([["layers.4.w", "float32", [-1]]]).encode(), "malformed"),
    (json.dumps([["layers.4.w", "float32", [2**39, 2**39]]]).encode(), "more than"),
    (json.dumps([["layers.4.w", "float32", [2]]] * 5000).encode(), "at most"),
])
def test_a_layer_header_that_a_move_never_sends_is_refused(header, message):
    with pytest.raises(TransferError, match=message):
        _parse_header(header, 4, 1)


def test_a_layer_is_bounded_by_its_own_state_so_a_forged_announcement_allocates_no_more():
    """move_stage builds the layers it gains before the exchange and bounds each by most_state_bytes:
    an envelope forged at the right place in the stream could announce up to MAX_LAYER_BYTES (64 GiB)."""
    config = preset("tiny")
    layer = build_layer(describe_model(ModelSpec(gpt=config), 0), 1, 0)  # a transformer block
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(2, 8, config.d_model)).sum().backward()
    optimizer.step()
    state = stage_state(nn.ModuleList([layer]), optimizer, 1)  # what a move sends of it
    honest = sum(t.numel() * t.element_size() for t in state.values())
    bound = most_state_bytes(layer)
    assert honest < bound < 4 * honest + 2**21  # the real state fits; a forgery gets a few MiB, not 64 GiB
    header = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in state.items()]).encode()
    assert len(_parse_header(header, 1, 0, bound)) == len(state)
    inflated = json.dumps([["layers.1.w", "float32", [bound // 4 + 1]]]).encode()
    with pytest.raises(TransferError, match=f"more than {bound:,} bytes"):
        _parse_header(inflated, 1, 0, bound)
