"""Runs one pipeline stage: its layer range, its links, its optimizer, one schedule per step.

The training step reads top to bottom in `train_step`: walk the schedule's typed actions
(runtime/actions.py: forward, full backward, or a backward split into the input's gradient I
and the weights' W (runtime/split_backward.py) of one micro-batch), receive inputs or
gradients from the neighbouring stages when an action needs them, send results on asynchronously, then
drain the sends and step the optimizer. Gradients accumulate over micro-batches; the
last stage computes the loss, scaled by 1/M so a step equals one big-batch step (with
several pipelines M is the global count, and `grad_sync` sums the pipelines' gradients
during the last backward — each stage's own, where the device runs several — before the
optimizer steps).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from hetlaunch.runtime import host_clock
from hetlaunch.runtime.boundary import Message, differentiable, map_tensors, tensors
from hetlaunch.runtime.data import token_ids_named
from hetlaunch.runtime.emulation import ComputeEmulation
from hetlaunch.runtime.grad_sync import GradientSync, SyncStats
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.local_link import LocalLink
from hetlaunch.runtime.memory_limit import StageMemory
from hetlaunch.runtime.outer_sync import OuterSync
from hetlaunch.runtime.optim import Recipe, clip_gradients, make_optimizer, set_lr
from hetlaunch.runtime.precision import LossScaler, autocast, compute_dtype, from_wire, to_wire
from hetlaunch.runtime.registry import DEFAULT_LINK_ROUNDING
from hetlaunch.runtime.wire_rounding import WireRounding
from hetlaunch.runtime.actions import B, E, F, I, W, Action
from hetlaunch.runtime.split_backward import SplitBackward
from hetlaunch.runtime.tied import TiedParameters

Batch = tuple[torch.Tensor, torch.Tensor]
_NO_SPAN = contextlib.nullcontext()


@dataclass
class StepResult:
    loss: float | None  # mean micro-batch loss; only on the last stage
    step_s: float
    compute_s: float
    comm_s: float
    # (raw, wire) bytes sent this step: activations to the next stage, gradients to the previous.
    forward_bytes: tuple[int, int] = (0, 0)
    backward_bytes: tuple[int, int] = (0, 0)
    sync_s: float = 0.0                # blocked on gradient sync with the other pipelines
    sync_bytes: tuple[int, int] = (0, 0)
    lr: float = 0.0                    # the learning rate this step used
    grad_norm: float = 0.0             # the whole model's gradient norm before clipping (0: not clipping)
    eval_loss: float | None = None     # the held-out loss of the step's E actions; only on the last stage
    # Several stages on this device: each one's share of compute_s, by stage index (empty with one).
    part_compute_s: dict[int, float] = field(default_factory=dict)


@dataclass
class _InFlight:
    """What a forward keeps until its backward: the stage's input and output (or loss), each a
    tensor or a tuple of tensors (runtime/boundary.py)."""

    inputs: Message
    output: Message


@dataclass(eq=False)
class StagePart:
    """One stage of the pipeline that this device runs. A device holds one, or several for the
    interleaved and V-shaped schedules (runtime/device_schedules.py): each is the next
    `num_layers` of the executor's layers, in order, with the links to the stages before and
    after it (a LocalLink where that stage is on this device too; None at the pipeline's ends)."""

    stage_index: int
    num_layers: int
    prev_link: Link | LocalLink | None
    next_link: Link | LocalLink | None
    # Evaluation forwards in the step (E actions): links of their own (another tag), so held-out
    # activations never queue among training's in the receiver's order.
    prev_eval_link: Link | LocalLink | None = None
    next_eval_link: Link | LocalLink | None = None
    module: nn.Sequential = field(init=False, default=None)

    @property
    def is_first(self) -> bool:
        return self.prev_link is None

    @property
    def is_last(self) -> bool:
        return self.next_link is None


@dataclass
class StageExecutor:
    layers: list[nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    is_first: bool
    is_last: bool
    device: torch.device
    prev_link: Link | None = None
    next_link: Link | None = None
    # Optimizer, learning-rate schedule, weight decay, clipping (runtime/optim.py).
    recipe: Recipe = field(default_factory=Recipe)
    # Clipping: turns this stage's sum of squared gradients into the whole model's (an
    # all-reduce over every stage of every pipeline); None in a single process.
    sum_over_model: Callable[[torch.Tensor], torch.Tensor] | None = None
    # fp32, or bf16/fp16 autocast over fp32 master weights (runtime/precision.py).
    precision: str = "fp32"
    link_rounding: str = DEFAULT_LINK_ROUNDING  # bf16 on links: runtime/wire_rounding.py
    # fp16: whether any stage's gradients overflowed (an all-reduce); None in a single process.
    any_over_model: Callable[[bool], bool] | None = None
    # Emulated slowdown: compute that took t seconds is stretched to t / speed.
    emulation: ComputeEmulation = field(default_factory=ComputeEmulation)
    # Several pipelines: sums this stage's gradients with the other holders of its layers.
    grad_sync: GradientSync | None = None
    # Several pipelines: waits until every stage of this pipeline may step (runtime/stage_command.py).
    before_optimizer_step: Callable[[], None] | None = None
    # Parameters tied to other stages' (runtime/tied.py): gradients summed among the holders.
    tied: TiedParameters | None = None
    # Measures this stage's tensors (their peak) and, under the node's memory limit, stops it when they go over.
    memory: StageMemory | None = None
    # Islands: the outer steps (runtime/outer_sync.py), taken by the stage loop after a step.
    outer: OuterSync | None = None
    # Several stages on this device (interleaved, V-shaped schedules): `layers` are theirs in
    # order, and is_first, is_last and the two links above are unused. Empty: the device runs one
    # stage, made of all of `layers` and the two links.
    parts: list[StagePart] = field(default_factory=list)
    # One stage, evaluation in the step's bubbles: its (previous, next) evaluation links.
    eval_links: tuple[Link | None, Link | None] = (None, None)
    module: nn.Sequential = field(init=False)
    optimizer: torch.optim.Optimizer | None = field(init=False)
    # Optimizer steps taken, counting those before a restore. It changes together with the
    # parameters, under `state_lock`, so a snapshot taken from another thread is one step's state.
    steps_done: int = field(init=False, default=0)
    _trace: list | None = field(init=False, default=None)  # this step's timeline, when it is traced
    _whole_in_i: bool = field(init=False, default=False)  # the graph cannot be split: an I does the weights too
    _ahead: bool = field(init=False, default=False)  # this step receives training messages ahead (_receive_ahead)
    state_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self):
        if not self.parts:
            if self.is_first != (self.prev_link is None) or self.is_last != (self.next_link is None):
                raise ValueError("a stage has a previous link unless it is first and a next link unless it is last")
            self.parts = [StagePart(-1, len(self.layers), self.prev_link, self.next_link, *self.eval_links)]
        else:
            indices = [part.stage_index for part in self.parts]
            if indices != sorted(set(indices)) or sum(part.num_layers for part in self.parts) != len(self.layers):
                raise ValueError(f"a device's stages must be distinct, in pipeline order, and hold its "
                                 f"{len(self.layers)} layers between them; got stages {indices} holding "
                                 f"{[part.num_layers for part in self.parts]}")
            self.is_first, self.is_last = self.parts[0].is_first, self.parts[-1].is_last
        self._part_of = {part.stage_index: part for part in self.parts} if len(self.parts) > 1 else None
        self.rebuild(self.layers)
        self._dtype = compute_dtype(self.precision)
        self.wire = WireRounding(self._dtype, self.link_rounding, self.device)  # training's casts at links
        self.scaler = LossScaler() if self.precision == "fp16" else None

    def rebuild(self, layers: list[nn.Module]) -> None:
        """Hold these layers from now on, with a fresh optimizer (a live move loads their state
        next; runtime/live_move.py). The loss scale and the step count are the stage's and stay."""
        self.layers = layers
        if len(self.parts) == 1:  # a live move changed how many layers the one stage holds
            self.parts[0].num_layers = len(layers)
        self.module = nn.Sequential(*self.layers).to(self.device)
        start = 0
        for part in self.parts:  # views of the same layers: one optimizer, one state for all
            part.module = self.module[start:start + part.num_layers]
            start += part.num_layers
        if self.memory is not None:
            self.memory.attach(self.module)
        # A stage with no parameters (e.g. a pure reshape) still runs; it has nothing to step.
        self.optimizer = make_optimizer(self.module, self.recipe)

    def train_step(self, actions: list[Action], microbatches: list[Batch] | None, loss_divisor: int,
                   trace: list[tuple[str, float, float, int]] | None = None,
                   eval_microbatches: list[Batch] | None = None) -> StepResult:
        """One optimizer step over the schedule's micro-batches, in its order.

        `microbatches` holds the (inputs, targets) pairs; the first stage reads inputs,
        the last stage reads targets, middle stages pass None. Each micro-batch's loss is
        divided by `loss_divisor`: the step's micro-batch count over all pipelines. With
        `trace` (a list) the step's timeline is appended to it: (name, start, end, micro-batch)
        in wall-clock seconds — every forward and backward, the waits for a message inside
        them, the drain of the sends, the gradient sync and the optimizer step. E actions evaluate
        `eval_microbatches` (held out) with the weights as they are before this step's update.
        """
        self._trace = trace
        if self.memory is not None:
            self.memory.begin_step(self.steps_done)
        step_start = time.perf_counter()
        links = self._links()
        sent_before = {id(link): (link.stats.raw_bytes, link.stats.wire_bytes) for link in links}
        self._compute_s = 0.0
        self._comm_s = 0.0
        in_flight: dict[tuple[int, int], _InFlight] = {}  # by (stage, micro-batch)
        weights_left: dict[tuple[int, int], SplitBackward] = {}  # after an I, until its W
        losses: list[float] = []
        eval_losses: list[float] = []
        evals_due: list[tuple[StagePart, int]] = []  # E's reached whose input had not arrived, in order
        # The action whose weight gradients are the step's last (gradient sync arms before it):
        # the last B or W, or where the stage's graph cannot be split (its I does the weights), B or I.
        last = {kinds: max((i for i, a in enumerate(actions) if a.kind in kinds), default=-1)
                for kinds in ((B, W), (B, I))}
        # With several stages on the device, each stage's last B or W arms that stage's buckets:
        # one stage's weights may be final before another's, and syncing them need not wait.
        several = len(self.parts) > 1
        last_of_part = {a.stage_index: i for i, a in enumerate(actions) if a.kind in (B, W)} if several else {}
        part_compute: dict[int, float] = {}
        self._receive_ahead(actions)
        for i, action in enumerate(actions):
            computed_before = self._compute_s
            mb, part = action.microbatch, self._part(action.stage_index)
            key = (action.stage_index, mb)
            if action.kind is F:
                with self.memory.forward(key) if self.memory else contextlib.nullcontext(), self._span("forward", mb):
                    in_flight[key] = self._forward(part, mb, microbatches, loss_divisor, losses)
            elif action.kind is E:
                # Where the prediction was early, an E whose input is not here yet waits for the next E's
                # place or the step's end rather than hold training up; held-out order is kept.
                evals_due.append((part, mb))
                while evals_due and (evals_due[0][0].is_first or evals_due[0][0].prev_eval_link.ready()):
                    self._evaluate_one(*evals_due.pop(0), eval_microbatches, eval_losses)
            elif action.kind is I:
                with self._span("input gradient", mb):
                    saved = in_flight.pop(key)
                    split = self._split(part, saved)
                    self._whole_in_i = split.whole_in_input_pass and not several
                    if self.grad_sync is not None and i == last[(B, I)] and self._whole_in_i:
                        self.grad_sync.arm()
                    self._send_input_grads(part, split, isinstance(saved.inputs, torch.Tensor))
                weights_left[key] = split
            else:  # B or W: the weights' gradients land
                if self.grad_sync is not None and several and i == last_of_part[action.stage_index]:
                    self.grad_sync.arm({id(p) for p in part.module.parameters()})  # this stage's final now
                elif self.grad_sync is not None and i == last[(B, I) if self._whole_in_i else (B, W)]:
                    self.grad_sync.arm()  # gradients become final during this backward
                if action.kind is B:
                    with self._span("backward", mb):
                        self._backward(part, in_flight.pop(key))
                else:
                    with self._span("weight gradient", mb):
                        self._timed(weights_left.pop(key).weight_grads)
                if self.memory is not None:
                    self.memory.backward_done(key)
            if several:
                part_compute[action.stage_index] = (part_compute.get(action.stage_index, 0.0)
                                                    + self._compute_s - computed_before)
        for part, k in evals_due:  # after the stage's training: as evaluation after the step would
            self._evaluate_one(part, k, eval_microbatches, eval_losses)
        if in_flight or weights_left:
            raise RuntimeError(f"schedule left micro-batches {sorted(in_flight)} without a backward and "
                               f"{sorted(weights_left)} without their weight gradients")
        with self._span("drain sends"):
            for link in links:
                self._comm_s += link.drain()
        with self._span("gradient sync"):
            sync = self.grad_sync.finish() if self.grad_sync is not None else SyncStats()
        if self.tied is not None:
            start = time.perf_counter()
            self.tied.sum_gradients()
            self._comm_s += time.perf_counter() - start
        if self.before_optimizer_step is not None:
            start = time.perf_counter()
            self.before_optimizer_step()
            self._comm_s += time.perf_counter() - start
        skip = False
        if self.scaler is not None:  # fp16: unscale; an overflow anywhere skips the step everywhere
            start = time.perf_counter()
            overflow = self.scaler.unscale(self.module)
            skip = self.any_over_model(overflow) if self.any_over_model is not None else overflow
            self.scaler.update(skip)
            self._comm_s += time.perf_counter() - start
        grad_norm = 0.0
        if self.recipe.grad_clip > 0 and not skip:  # after the sync: every replica clips the same summed gradient
            start = time.perf_counter()
            grad_norm = clip_gradients(self.module, self.recipe.grad_clip, self.sum_over_model or (lambda t: t),
                                       self.tied.duplicates if self.tied is not None else frozenset())
            self._comm_s += time.perf_counter() - start
        lr = self.recipe.lr_at(self.steps_done)
        with self._span("optimizer"):
            self._timed(self._optimizer_step, lr, skip)
        if self.memory is not None:
            self.memory.check(self.module, self.optimizer, f"at step {self.steps_done - 1}")
        loss = sum(losses) / len(losses) if self.is_last else None

        def sent(side: str) -> tuple[int, int]:
            pairs = [(link.stats.raw_bytes - sent_before[id(link)][0], link.stats.wire_bytes - sent_before[id(link)][1])
                     for link in (getattr(part, side) for part in self.parts) if link is not None]
            return (sum(raw for raw, _ in pairs), sum(wire for _, wire in pairs))

        return StepResult(loss=loss, step_s=time.perf_counter() - step_start, compute_s=self._compute_s,
                          comm_s=self._comm_s, forward_bytes=sent("next_link"),
                          backward_bytes=sent("prev_link"), sync_s=sync.blocked_s,
                          sync_bytes=(sync.raw_bytes, sync.wire_bytes), lr=lr, grad_norm=grad_norm,
                          eval_loss=sum(eval_losses) / len(eval_losses) if eval_losses else None,
                          part_compute_s=part_compute)

    @torch.no_grad()
    def evaluate(self, microbatches: list[Batch] | None, count: int) -> float | None:
        """The mean loss over `count` held-out micro-batches, forward only, passed down the
        pipeline in order; the last stage returns it, the others None. No state changes."""
        losses = []
        for part in self.parts:  # in pipeline order: sends do not wait, so a device's stages go one by one
            for mb in range(count):
                inputs = microbatches[mb][0].to(self.device) if part.is_first else part.prev_link.recv()
                with autocast(self.device, self._dtype):
                    with token_ids_named(part.is_first, inputs):
                        output = part.module(map_tensors(lambda t: from_wire(t, self._dtype), inputs))
                    if part.is_last:
                        losses.append(self.loss_fn(output, microbatches[mb][1].to(self.device)).item())
                if not part.is_last:
                    part.next_link.send(map_tensors(lambda t: to_wire(t, self._dtype), output))
        for part in self.parts:
            if part.next_link is not None:
                part.next_link.drain()
        return sum(losses) / len(losses) if self.is_last else None

    def stop_receiving(self) -> bool:
        """After a failed step: drop the receives posted ahead and not begun; whether one is still
        running (inside c10d, where the group must not be destroyed under it)."""
        return any([link.stop_receiving() for link in self._links() + [p.prev_eval_link for p in self.parts]
                    if link is not None])

    def _receive_ahead(self, actions: list[Action]) -> None:
        """Post the step's receives on the links' own threads, so their bytes move while this
        thread computes (gloo moves a message only once its receive is posted).

        Evaluation receives always: an E sees whether its input has come (Link.ready). Training
        receives only where the device's order has no split backward: received ahead, interleaved
        1F1B ran 1.00-1.06x torch's instead of 0.93x on 2026-12-03 (0.985x against 0.935x,
        alternated, on 2026-12-05), but ZB-V 0.87-0.90x instead of 1.03x
        (bench/vs_torch_device_schedules.py; the receiving thread competes for the GIL with the
        split backward's Python). Counts are exact, so nothing waits on the wire after the step:
        an activation per F of a stage that is not first, and a gradient per F whose output has a
        floating element (posted by _forward, which knows; the next stage sends one exactly then)."""
        self._ahead = not any(a.kind is I or a.kind is W for a in actions)
        for part in self.parts:
            mine = [a for a in actions if self._part(a.stage_index) is part]
            if part.prev_eval_link is not None:
                part.prev_eval_link.expect(sum(1 for a in mine if a.kind is E))
            if self._ahead and not part.is_first:
                part.prev_link.expect(sum(1 for a in mine if a.kind is F))

    def _links(self) -> list[Link | LocalLink]:
        return [link for part in self.parts for link in (part.prev_link, part.next_link, part.next_eval_link)
                if link is not None]

    def _evaluate_one(self, part: StagePart, k: int, eval_microbatches: list[Batch] | None,
                      eval_losses: list[float]) -> None:
        with self._span("eval forward", k):
            self._eval_forward(part, k, eval_microbatches, eval_losses)

    @torch.no_grad()
    def _eval_forward(self, part: StagePart, k: int, eval_microbatches: list[Batch] | None,
                      eval_losses: list[float]) -> None:
        """E: held-out micro-batch k through this stage, as `evaluate` computes it; the random
        state is put back after, so training's dropout draws what it would without the E."""
        if part.is_first:
            inputs = eval_microbatches[k][0].to(self.device)
        else:
            inputs = self._received(part.prev_eval_link)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                autocast(self.device, self._dtype):
            with token_ids_named(part.is_first, inputs):
                output = self._timed(part.module, map_tensors(lambda t: from_wire(t, self._dtype), inputs))
            if part.is_last:
                eval_losses.append(self.loss_fn(output, eval_microbatches[k][1].to(self.device)).item())
        if not part.is_last:
            part.next_eval_link.send(map_tensors(lambda t: to_wire(t, self._dtype), output))

    def _part(self, stage_index: int) -> StagePart:
        """The part an action's stage runs on; with one part, whatever stage its actions name."""
        if self._part_of is None:
            return self.parts[0]
        try:
            return self._part_of[stage_index]
        except KeyError:
            raise ValueError(f"the schedule gives this device an action of stage {stage_index}, which it does "
                             f"not hold (it holds {sorted(self._part_of)})") from None

    def _forward(self, part: StagePart, mb: int, microbatches: list[Batch] | None, loss_divisor: int,
                 losses: list[float]) -> _InFlight:
        if part.is_first:
            inputs = x = microbatches[mb][0].to(self.device, non_blocking=True)
        else:  # received in the compute dtype; computed on in fp32, the gradient goes back in it
            inputs = self._received(part.prev_link)
            for t in differentiable(inputs):
                t.requires_grad_()
            x = map_tensors(self.wire.receive, inputs)
        with autocast(self.device, self._dtype):
            with token_ids_named(part.is_first, x):
                output = self._timed(part.module, x)
            if part.is_last:
                targets = microbatches[mb][1].to(self.device, non_blocking=True)
                loss = self._timed(self.loss_fn, output, targets)
        if part.is_last:
            losses.append(loss.item())
            scaled = loss / loss_divisor
            if self.scaler is not None:  # in fp32: a half-precision loss times 2**16 would overflow here
                scaled = scaled.float() * self.scaler.scale
            return _InFlight(inputs, scaled)
        output = map_tensors(self.wire.send, output)
        part.next_link.send(output)
        if self._ahead and differentiable(output):
            part.next_link.expect(1)  # its gradient: the next stage sends one for this output
        return _InFlight(inputs, output)

    def _backward(self, part: StagePart, saved: _InFlight) -> None:
        if part.is_last:
            self._timed(saved.output.backward)
        else:
            outputs, grads = self._output_grads(part, saved)
            if outputs:
                self._timed(torch.autograd.backward, outputs, grads)
        if not part.is_first:
            inputs = differentiable(saved.inputs)
            if inputs:  # an input this stage did not use gets a zero gradient: the sender waits for one per element
                grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
                part.prev_link.send(grads[0] if isinstance(saved.inputs, torch.Tensor) else tuple(grads))

    def _split(self, part: StagePart, saved: _InFlight) -> SplitBackward:
        """An I's backward: the next stage's gradient received (or the loss), the graph analysed."""
        outputs, grads = ([saved.output], [None]) if part.is_last else self._output_grads(part, saved)
        inputs = [] if part.is_first else list(differentiable(saved.inputs))
        return SplitBackward(outputs, grads, inputs, list(part.module.parameters()))

    def _output_grads(self, part: StagePart, saved: _InFlight) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The stage's outputs that need a gradient and the gradients the next stage sent for them
        (it sends one per floating element; none is received when the output has none)."""
        if not differentiable(saved.output):
            return [], []
        received = tensors(self._received(part.next_link))
        pairs = [(out, grad) for out, grad in zip(differentiable(saved.output), received) if out.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _send_input_grads(self, part: StagePart, split: SplitBackward, lone_tensor: bool) -> None:
        """I: the input's gradient, sent upstream at once (zeros for an input the stage did not use),
        as _backward sends it: a tensor for a lone tensor input, else a tuple."""
        grads = self._timed(split.input_grads)
        if part.is_first or not split.inputs:
            return
        grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, split.inputs)]
        part.prev_link.send(grads[0] if lone_tensor else tuple(grads))

    def _optimizer_step(self, lr: float, skip: bool = False) -> None:
        with self.state_lock:
            if self.optimizer is not None:
                set_lr(self.optimizer, lr)
                if not skip:
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.steps_done += 1

    def _received(self, link: Link | LocalLink) -> Message:
        start = time.perf_counter()
        with self._span("recv"):
            tensor = link.recv()
        self._comm_s += time.perf_counter() - start
        return tensor

    def _span(self, name: str, microbatch: int = -1):
        """Time a piece of the step for the timeline, when this step is traced; on the other
        steps (most of them) a shared no-op, so the step loop builds no generator per action."""
        return _NO_SPAN if self._trace is None else self._traced(name, microbatch)

    @contextlib.contextmanager
    def _traced(self, name: str, microbatch: int):
        start = host_clock.now()
        try:
            yield
        finally:
            self._trace.append((name, start, host_clock.now(), microbatch))

    def _timed(self, fn, *args):
        """Run compute, count its time, and stretch it when this node emulates a slower device."""
        start = time.perf_counter()
        mark = self.emulation.start()
        result = fn(*args)
        self.emulation.stretch(mark, self.device)
        self._compute_s += time.perf_counter() - start
        return result

