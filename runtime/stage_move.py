"""A live move: layers change stages at a step boundary, over the data plane, in the running workers.

The coordinator (launcher/live_move.py) sends every stage of the generation three messages with
one id. HOLD: the stage answers the step it runs (or runs next), `r`, finishes it and begins no
other until told more. GO: move before step `S`, where the coordinator took `S` one past the
largest `r` — a step no stage can have begun, since none passes its hold. CANCEL: carry on as
before. A stage held before `S` is released by GO and runs on to `S`; the holds cannot deadlock
the pipeline because GO comes from the coordinator, not from the other stages. Messages arrive on
the worker's control thread while the main thread may be blocked mid-step; the main thread
looks at the gate at every step boundary.

Before step `S` every rank of the data plane: waits for its last checkpoint write, copies its
layers' state, sends the layers it gives away and receives those it gains (runtime/layer_transfer.py),
rebuilds its layers, optimizer, gradient-sync and tied-parameter groups for the new layout, and
points its links at the new boundary's codecs. Parameters and optimizer state travel whole, the
per-step RNG is seeded by the step, and the schedule and micro-batches do not change, so the
steps after the move compute what they would have computed without it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint import apply_state, stage_state
from hetlaunch.runtime.checkpoint_manifest import layer_of
from hetlaunch.runtime.codecs import codec_by_id
from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.grad_sync import GradientSync, make_groups, sealed_plans, sync_group_plans
from hetlaunch.runtime.layer_transfer import SealedTransfers, exchange, most_state_bytes
from hetlaunch.runtime.model import build_layer, describe_model
from hetlaunch.runtime.model_spec import ModelSpec
from hetlaunch.runtime.tied import TiedParameters
from hetlaunch.runtime.transfer_plan import transfers

HOLD_TIMEOUT_S = 300.0  # a coordinator that never says go or cancel: the stage fails instead of hanging


class MoveGate:
    """Where the control thread's move messages meet the main thread's step boundaries."""

    def __init__(self, report: Callable[[pb.MoveReport], None], next_step: int):
        self._cond = threading.Condition()
        self._report = report
        self._running = next_step  # the step being run, or the next one at a boundary
        self._hold_before: int | None = None
        self._go: pb.Move | None = None

    def control(self, move: pb.Move) -> None:
        """A message from the coordinator (control thread)."""
        with self._cond:
            if move.phase == pb.MOVE_PHASE_HOLD:
                self._hold_before = self._running + 1
                self._report(pb.MoveReport(id=move.id, phase=pb.MOVE_PHASE_HOLD, step=self._running, ok=True))
            elif move.phase == pb.MOVE_PHASE_GO:
                self._go, self._hold_before = move, None
            else:
                self._go = self._hold_before = None
            self._cond.notify_all()

    def before_step(self, step: int) -> pb.Move | None:
        """At the boundary before `step` (main thread): the move to make now, if any; waits while held."""
        with self._cond:
            self._running = step
            deadline = time.monotonic() + HOLD_TIMEOUT_S
            while self._hold_before is not None and step >= self._hold_before and self._go is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"held for a live move before step {step} for {HOLD_TIMEOUT_S:.0f} s "
                                       "and never told to go on")
                self._cond.wait(left)
            go = self._go
            if go is None or go.at_step > step:
                return None
            self._go = None
            if go.at_step < step:  # the coordinator's choice of S makes this impossible; never move late
                raise RuntimeError(f"told to move layers before step {go.at_step}, but step {step} is running")
            return go

    def finished(self, steps: int) -> None:
        """No step is left: a hold answers `steps`, and the coordinator cancels."""
        with self._cond:
            self._running = steps


@dataclass
class RunningStage:
    """What a move changes in a running stage (runtime/stage_command.py builds it)."""

    executor: StageExecutor
    spec: ModelSpec
    seed: int
    rank: int
    layout: list[pb.StagePlace]
    layer_start: int
    layer_end: int
    wire: torch.device
    tied_groups: tuple[tuple[str, ...], ...]
    on_range: Callable[[int, int], None]  # the checkpoint writer and the snapshot handler follow the range
    rdzv: pb.Rendezvous | None = None     # data_plane.encrypt: what seals the moves and the rebuilt groups
    sealed_transfers: SealedTransfers | None = None  # made at the first move, kept for the generation


def retarget_links(executor: StageExecutor, spec: pb.StageSpec) -> None:
    """A move changed the layers at this stage's boundaries: every link across them, training's and
    evaluation's (runtime/bubble_fill.py), takes the new boundary's codec and size bound."""
    prev_eval, next_eval = executor.eval_links
    for link in (executor.prev_link, prev_eval):
        if link is not None:
            link.retarget(codec_by_id(spec.prev.backward_codec), spec.prev.max_message_bytes)
    for link in (executor.next_link, next_eval):
        if link is not None:
            link.retarget(codec_by_id(spec.next.forward_codec), spec.next.max_message_bytes)


def move_stage(stage: RunningStage, move: pb.Move) -> pb.MoveReport:
    """Make the move on this rank (every rank of the data plane makes it at the same boundary)."""
    start = time.perf_counter()
    executor = stage.executor
    new_layout = list(move.layout)
    mine = next(p for p in new_layout if p.rank == stage.rank)
    with executor.state_lock:
        state = stage_state(executor.module, executor.optimizer, stage.layer_start)
    if stage.rdzv is not None and stage.rdzv.data_plane_encrypt not in ("", "off") and stage.sealed_transfers is None:
        stage.sealed_transfers = SealedTransfers(stage.rdzv, stage.layout)  # ranks keep their regions in a generation
    # Every rank builds fresh layers, even with an unchanged range: the old ones carry the old
    # gradient-sync hooks, and the sync groups change with any pipeline's cut. Built before the
    # exchange, they bound what each layer received may announce.
    model = describe_model(stage.spec, stage.seed)
    layers = [build_layer(model, i, stage.seed) for i in range(mine.layer_start, mine.layer_end)]
    bounds = {mine.layer_start + i: most_state_bytes(layer) for i, layer in enumerate(layers)}
    received, sent, got = exchange(transfers(stage.layout, new_layout), stage.rank, state, stage.wire,
                                   stage.sealed_transfers, bounds)
    keep = {k: v for k, v in state.items() if mine.layer_start <= layer_of(k) < mine.layer_end}
    with executor.state_lock:
        executor.rebuild(layers)
        apply_state(executor.module, executor.optimizer, {**keep, **received}, mine.layer_start)
    dp = move.data_parallel if move.HasField("data_parallel") else None
    # Sealed groups built again in this generation get streams of their own, so keys of their own:
    # under the old names a recording of the groups before the move opened again after it.
    epoch = f" move {move.id}"
    executor.grad_sync = None
    if dp is not None and dp.sync_groups:  # every rank makes every group, in order
        plans = sealed_plans(sync_group_plans(dp), new_layout, stage.rdzv.data_plane_encrypt if stage.rdzv else "off")
        executor.grad_sync = GradientSync(executor.layers, mine.layer_start, plans, make_groups(plans), stage.wire,
                                          stage.rdzv, epoch=epoch)
    if stage.tied_groups:
        executor.tied = TiedParameters(stage.tied_groups, new_layout, stage.rank, executor.module,
                                       mine.layer_start, stage.wire, stage.rdzv, epoch=epoch)
    retarget_links(executor, move.stage)
    stage.layout, stage.layer_start, stage.layer_end = new_layout, mine.layer_start, mine.layer_end
    stage.on_range(mine.layer_start, mine.layer_end)
    return pb.MoveReport(id=move.id, phase=pb.MOVE_PHASE_GO, step=move.at_step, ok=True, bytes_sent=sent,
                         bytes_received=got, seconds=time.perf_counter() - start,
                         layer_start=mine.layer_start, layer_end=mine.layer_end)
