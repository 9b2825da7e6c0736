"""Turn a RunStage command into a running stage: model range, data, data-plane group, links, steps."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.checkpoint import apply_state, load_layers, resumed_step_of, split_outer, stage_state, write_part
from hetlaunch.runtime.checkpoint_manifest import read_manifest
from hetlaunch.runtime.checkpoint_writer import CheckpointWriter, part_message
from hetlaunch.runtime.codecs import codec_by_id
from hetlaunch.runtime.data_plane import init_data_plane, wire_device
from hetlaunch.runtime.devices import resolve_device
from hetlaunch.runtime.data import TokenBatches, open_data
from hetlaunch.runtime.emulation import WireEmulation, emulated_speed
from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.grad_sync import GradientSync, make_groups, sealed_plans, sync_group_plans
from hetlaunch.runtime.stage_move import MoveGate, RunningStage, move_stage
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.memory_limit import StageMemory
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.optim import Recipe
from hetlaunch.runtime.outer_sync import OuterGroupPlan, OuterSettings, OuterStats, OuterSync
from hetlaunch.runtime.schedules import schedule_for
from hetlaunch.runtime.sealed_exchange import SealedGather, must_seal, regions_of, sealed_gather_for
from hetlaunch.runtime.sealing import REFUSED, Channel, Opener, Sealer, SealingError, peer_secret
from hetlaunch.runtime.step_evaluation import StepEvaluation
from hetlaunch.runtime.tied import TiedParameters
from hetlaunch.runtime.registry import DEFAULT_LINK_ROUNDING
from hetlaunch.runtime.wire import model_spec_from_proto, schedule_name


# Held-out activations in the step's bubbles travel on links of their own, under this tag.
EVAL_TAG = 1


def _links(stage: pb.StageSpec, device: torch.device, rdzv: pb.Rendezvous, stream: str = "link",
           tag: int = 0) -> tuple[Link | None, Link | None]:
    wire = wire_device(device, rdzv.backend)
    prev = next_ = None
    if stage.HasField("prev"):  # we send gradients back to the previous stage
        prev = Link(stage.prev.peer_rank, codec_by_id(stage.prev.backward_codec), device, wire,
                    emulation=WireEmulation.from_spec(stage.prev.emulate_bandwidth_mbps, stage.prev.emulate_latency_ms,
                                                      bool(stage.prev.bandwidth_changes)),
                    max_message_bytes=stage.prev.max_message_bytes, sealing=_sealing(stage.prev, rdzv, stream),
                    tag=tag)
    if stage.HasField("next"):  # we send activations on to the next stage
        next_ = Link(stage.next.peer_rank, codec_by_id(stage.next.forward_codec), device, wire,
                     emulation=WireEmulation.from_spec(stage.next.emulate_bandwidth_mbps, stage.next.emulate_latency_ms,
                                                       bool(stage.next.bandwidth_changes)),
                     max_message_bytes=stage.next.max_message_bytes, sealing=_sealing(stage.next, rdzv, stream),
                     tag=tag)
    return prev, next_


def _sealing(link: pb.LinkSpec, rdzv: pb.Rendezvous, stream: str) -> tuple[Sealer, Opener] | None:
    """A sealed link's two channels (runtime/sealing.py): what we send the peer, what it sends us."""
    if not link.sealed:
        return None
    me, peer = rdzv.rank, link.peer_rank
    secret = peer_secret(rdzv, peer, f"the link to rank {peer}")
    return (Sealer(secret, Channel(rdzv.generation, me, peer, stream)),
            Opener(secret, Channel(rdzv.generation, peer, me, stream)))


class StageReports(Protocol):
    """Where a stage's reports go (runtime/worker.py: to the agent, over a pipe)."""

    def step(self, metrics: pb.StepMetrics) -> None: ...
    def checkpoint(self, part: pb.CheckpointPart) -> None: ...
    def on_snapshot(self, handler: Callable[[str], pb.CheckpointPart] | None) -> None: ...
    def move(self, report: pb.MoveReport) -> None: ...
    def on_move(self, handler: Callable[[pb.Move], None] | None) -> None: ...


def step_rng_seed(seed: int, step: int) -> int:
    """Every step starts from torch.manual_seed(this): a run resumed at step k, on any cut,
    draws what an uninterrupted one draws — no per-process RNG state to save and reshard."""
    digest = hashlib.blake2b(f"hetlaunch-step:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def link_rounding_seed(seed: int, step: int, stage_index: int) -> int:
    """The step's seed of a stage's stochastic rounding at its links (runtime/wire_rounding.py):
    its own stream, so dropout's draws are those of a run that rounds to nearest."""
    digest = hashlib.blake2b(f"hetlaunch-link-rounding:{seed}:{step}:{stage_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def checkpoint_due(train: pb.TrainSpec, done: int) -> bool:
    """Whether a checkpoint is written after `done` steps: every checkpoint_every steps and after
    the last; checkpoint_every 0 is never, not even after the last (as the README and the YAML's
    train.checkpoint_every say)."""
    return train.checkpoint_every > 0 and (done % train.checkpoint_every == 0 or done == train.steps)


def _snapshot_handler(executor: StageExecutor, layer_start: int, layer_end: int):
    """Write the state as of the last finished optimizer step; called on the worker's control
    thread while the main thread may be blocked on a dead peer. The state lock is kept: no
    optimizer step may change the state after it was written (the worker exits next)."""
    def snapshot(directory: str) -> pb.CheckpointPart:
        executor.state_lock.acquire()
        state = stage_state(executor.module, executor.optimizer, layer_start, executor.outer)
        part = write_part(Path(directory), state, layer_start, layer_end)
        return part_message(Path(directory), part, executor.steps_done, snapshot=True)
    return snapshot


def recipe_of(train: pb.TrainSpec) -> Recipe:
    """The TrainSpec's recipe; an empty name or zero is the default (older launchers send none)."""
    return Recipe(lr=train.lr, weight_decay=train.weight_decay, optimizer=train.optimizer or "adamw",
                  momentum=train.momentum, lr_schedule=train.lr_schedule or "constant",
                  warmup_steps=train.warmup_steps, min_lr_ratio=train.min_lr_ratio, total_steps=train.steps,
                  grad_clip=train.grad_clip)


class Island:
    """The ranks this stage trains the model with every step: the whole data plane, or with
    islands its own island (its group; None where the island is this one rank). Its scalar
    all-reduces (the clipping norm, fp16's overflow flag) are sealed where data_plane.encrypt
    covers its ranks: even a norm is the model's, and an unauthenticated one could be forged."""

    def __init__(self, dp: pb.DataParallel | None, rank: int, layout: Sequence[pb.StagePlace] = (),
                 rdzv: pb.Rendezvous | None = None):
        self.group: object | None = None
        self.pipelines = len(dp.pipeline_sizes) if dp is not None and dp.pipeline_sizes else 1
        self.alone = False
        self.sealed: SealedGather | None = None
        if dp is None or not dp.islands:
            ranks = sorted(place.rank for place in layout)
            if must_seal(rdzv.data_plane_encrypt if rdzv else "off", regions_of(layout, ranks)):
                # Its own group: on the default one its messages could meet the links' (same peers, same tag).
                self.group = dist.new_group(ranks)
                self.sealed = SealedGather(rdzv, ranks, "island reduce", self.group)
            return
        starts = [sum(dp.pipeline_sizes[:p]) for p in range(len(dp.pipeline_sizes))]
        for island in dp.islands:  # every rank makes every island's group, in order (c10d requires it)
            ranks = list(island.ranks)
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                self.group, self.alone = group, len(ranks) == 1
                self.pipelines = sum(1 for s in starts if s in ranks)
                if not self.alone:  # in rank order, as the clear path's all-gather lists them
                    self.sealed = sealed_gather_for(rdzv, layout, sorted(ranks), "island reduce", group)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """SUM adds the members' values in rank order, sealed or not (an all-gather of a scalar
        costs what its all-reduce does): a sealed run then clips by the same bits as a clear one,
        whatever order gloo's all-reduce would have added them in. MAX has no order."""
        if self.alone:
            return
        if self.sealed is not None:
            self.sealed.all_reduce(tensor, op)
        elif op == dist.ReduceOp.SUM:
            parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, tensor, group=self.group)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            tensor.copy_(total)
        else:
            dist.all_reduce(tensor, op=op, group=self.group)


def _sum_over_model(island: Island, device: torch.device, backend: str):
    """For clipping: every rank's sum of squared gradients, summed over its island (the whole
    data plane without islands), is the model's summed once per pipeline (after the sync, every
    pipeline of an island holds the same gradients for every layer), so divide by the pipeline count."""
    wire = wire_device(device, backend)

    def sum_over_model(local: torch.Tensor) -> torch.Tensor:
        total = local.detach().reshape(1).to(wire, torch.float32)
        island.all_reduce(total)
        return total[0] / island.pipelines
    return sum_over_model


def _any_over_model(island: Island, device: torch.device, backend: str):
    """fp16: whether any rank of the island saw an overflow (one all-reduce)."""
    wire = wire_device(device, backend)

    def any_over_model(flag: bool) -> bool:
        total = torch.tensor([1.0 if flag else 0.0], device=wire)
        island.all_reduce(total, op=dist.ReduceOp.MAX)
        return bool(total[0] > 0)
    return any_over_model


def _outer_sync(dp: pb.DataParallel | None, layout: list[pb.StagePlace], bundle, layer_start: int,
                wire: torch.device, state_lock, rdzv: pb.Rendezvous | None = None) -> OuterSync | None:
    """The stage's outer steps with islands (None without). Per outer group: the representatives'
    group (the first holder of each island), then each island's holders' group where it has
    several; made by every rank, in this order (c10d requires it)."""
    if dp is None or not dp.HasField("outer"):
        return None
    spec = dp.outer
    settings = OuterSettings(every=spec.every, lr=spec.lr, momentum=spec.momentum, fragments=spec.fragments or 1,
                             delay=spec.delay, alpha=spec.alpha)
    island_of = {r: i for i, island in enumerate(dp.islands) for r in island.ranks}
    pipeline_of = {place.rank: place.pipeline for place in layout}
    tokens = [sum(dp.pipeline_microbatches[p] for p in {pipeline_of[r] for r in island.ranks})
              for island in dp.islands]
    weights = tuple(t / sum(tokens) for t in tokens)
    plans, groups, me = [], [], dist.get_rank()
    for group in spec.groups:
        by_island = [[r for r in group.ranks if island_of[r] == i] for i in range(len(dp.islands))]
        representatives = tuple(ranks[0] for ranks in by_island)
        exchange = dist.new_group(list(representatives))
        mine = next((ranks for ranks in by_island if me in ranks), [])
        island_groups = {i: dist.new_group(ranks) for i, ranks in enumerate(by_island) if len(ranks) > 1}
        plans.append(OuterGroupPlan(group.layer_start, group.layer_end, representatives, weights, tuple(mine),
                                    codec_by_id(group.codec),
                                    WireEmulation.from_spec(group.emulate_bandwidth_mbps, group.emulate_latency_ms)))
        sealed = sealed_gather_for(rdzv, layout, representatives, f"outer {group.layer_start}-{group.layer_end - 1}",
                                   exchange) if me in representatives else None
        # The average the representative passes on crosses the island's own links: sealed where
        # data_plane.encrypt covers them (`all`, or an island whose pipelines span regions).
        shared = sealed_gather_for(rdzv, layout, mine, f"outer share {group.layer_start}-{group.layer_end - 1}",
                                   island_groups.get(island_of[me])) if len(mine) > 1 else None
        groups.append(None if not mine else (exchange if me in representatives else None,
                                             island_groups.get(island_of[me]), sealed, shared))
    return OuterSync(bundle.layers, layer_start, bundle.num_layers, settings, plans, groups, wire, state_lock,
                     tied=bundle.tied)


def _pipeline_barrier(dp: pb.DataParallel | None, rank: int, device: torch.device, backend: str,
                      layout: Sequence[pb.StagePlace] = (), rdzv: pb.Rendezvous | None = None):
    """With several pipelines: a barrier of this stage's pipeline before each optimizer step, so
    either every surviving stage of a pipeline took step s or none did (a stage whose sync partner
    died cannot take it). Without it, stage 0 could be a step ahead of stage 1 after a loss and no
    pipeline would hold all layers at one step. Costs one small all-reduce over the pipeline a step.
    Every rank creates every pipeline's group, in order (c10d requires it)."""
    if dp is None or len(dp.pipeline_sizes) < 2:
        return None
    mine, sealed, start = None, None, 0
    for size in dp.pipeline_sizes:
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks)
        if start <= rank < start + size and size > 1:
            mine = group
            sealed = sealed_gather_for(rdzv, layout, ranks, "pipeline barrier", group)
        start += size
    if mine is None:
        return None
    token = torch.zeros(1, device=wire_device(device, backend))

    def barrier() -> None:
        if sealed is not None:  # authenticated: a forged token would let a stage step alone
            sealed.all_reduce(token)
        else:
            dist.all_reduce(token, group=mine)
    return barrier


def run_stage(cmd: pb.RunStage, reports: StageReports, store: wpb.StoreAccess) -> None:
    """Train this node's stage from train.start_step to the last step; report one StepMetrics per step."""
    stage, train = cmd.stage, cmd.train
    if stage.threads:
        torch.set_num_threads(stage.threads)
    device = resolve_device(stage.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = model_spec_from_proto(cmd.model)
    memory = _stage_memory(stage, device)  # before building: on CUDA the allocator's cap must be in place first
    bundle = build_model_range(spec, stage.layer_start, stage.layer_end, seed=train.seed)
    if stage.stage_index == stage.num_stages - 1 and stage.layer_end != bundle.num_layers:
        # the loss belongs after the model's last layer
        raise ValueError(f"the last stage ends at layer {stage.layer_end}, but the model has {bundle.num_layers} "
                         f"layers: the pinned layers must cover [0, {bundle.num_layers})")
    restored = None
    if cmd.HasField("restore"):  # read before joining the group: a bad checkpoint fails this stage alone
        directory = Path(cmd.restore.checkpoint_dir)
        restored = load_layers(directory, read_manifest(directory), stage.layer_start, stage.layer_end)
    batches = eval_batches = None
    if stage.stage_index in (0, stage.num_stages - 1):  # middle stages never touch the data
        d = cmd.data
        batches, eval_batches = open_data(d.path, d.format, d.dtype, spec.seq_len, d.seed, bundle.vocab_size,
                                          d.eval_fraction if train.eval_every else 0.0)
    init_data_plane(cmd.rendezvous, store)
    executor = None
    try:
        executor = _executor(cmd, bundle, device, memory, restored)
        snapshot = _snapshot_handler(executor, stage.layer_start, stage.layer_end)
        reports.on_snapshot(snapshot)
        held = [stage.layer_start, stage.layer_end]  # the stage's layers, as live moves change them

        def copy_parts() -> list[tuple[int, int, dict]]:
            start, end = held
            return [(start, end, stage_state(executor.module, executor.optimizer, start, executor.outer))]
        writer = (CheckpointWriter(executor.state_lock, copy_parts, train.checkpoint_dir, reports)
                  if train.checkpoint_dir and train.checkpoint_every and train.save_part else None)

        def on_range(start: int, end: int) -> None:  # after a live move
            nonlocal snapshot
            snapshot = _snapshot_handler(executor, start, end)
            reports.on_snapshot(snapshot)
            held[:] = [start, end]  # the next checkpoint is of the new range
        running = RunningStage(executor, spec, train.seed, cmd.rendezvous.rank, list(cmd.layout), stage.layer_start,
                               stage.layer_end, wire_device(device, cmd.rendezvous.backend), bundle.tied, on_range,
                               cmd.rendezvous)
        gate = MoveGate(reports.move, train.start_step)
        reports.on_move(gate.control)
        try:
            _train(cmd, executor, batches, eval_batches, writer, reports, gate, running)
        except SealingError as err:
            raise _named_refusal(err, cmd.layout) from None
        except Exception:
            if train.snapshot_dir:  # before reporting the failure: a replica may stand in for a lost node
                try:
                    reports.checkpoint(snapshot(train.snapshot_dir))
                except Exception as err:  # the failure reported is the one that ended the stage
                    print(f"snapshot after the failure not written: {err}", file=sys.stderr, flush=True)
            raise
    finally:
        reports.on_move(None)
        # A step that failed may leave a link's thread inside a receive (runtime/link.py expect): the
        # group is not torn down under it; the process ends and its sockets with it.
        if executor is None or not executor.stop_receiving():
            dist.destroy_process_group()


def _named_refusal(err: SealingError, layout) -> Exception:
    """A refused message as the one line the coordinator reads as the link's fault: the two nodes,
    their ranks, the stream and the generation (no snapshot: nothing of this stage is lost, and
    the job ends rather than restart on a link someone tampers with)."""
    channel = err.channel
    if channel is None:
        return err
    node = {place.rank: place.node for place in layout}
    return SealingError(f"{REFUSED} from node {node.get(channel.sender, '?')} (rank {channel.sender}) to node "
                        f"{node.get(channel.receiver, '?')} (rank {channel.receiver}), generation "
                        f"{channel.generation}: {err}", channel)


def _stage_memory(stage: pb.StageSpec, device: torch.device) -> StageMemory:
    """The stage's memory, measured and capped: at its emulated memory_gb, else its memory_fraction
    of a CUDA device, else measured only (limit 0)."""
    if stage.emulate.memory_gb > 0:
        return StageMemory(int(stage.emulate.memory_gb * 2**30), device,
                           f"this node's emulate.memory_gb ({stage.emulate.memory_gb:g} GiB)")
    if stage.memory_fraction > 0 and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return StageMemory(int(stage.memory_fraction * total), device,
                           f"this node's memory_fraction ({stage.memory_fraction:g} of {total / 2**30:.1f} GiB)")
    return StageMemory(0, device)


def _executor(cmd: pb.RunStage, bundle, device: torch.device, memory: StageMemory,
              restored) -> StageExecutor:
    """The stage's executor on the data plane just joined: its links, gradient sync, pipeline barrier
    and tied parameters (these groups made in the same order on every rank), state restored if given."""
    stage, train, backend = cmd.stage, cmd.train, cmd.rendezvous.backend
    dp = cmd.data_parallel if cmd.HasField("data_parallel") else None
    prev_link, next_link = _links(stage, device, cmd.rendezvous)
    # Evaluation in the step's bubbles (runtime/step_evaluation.py): links of its own.
    eval_links = _links(stage, device, cmd.rendezvous, "eval", EVAL_TAG) if train.eval_every and stage.eval_fill \
        else (None, None)
    grad_sync = None
    island = Island(dp, cmd.rendezvous.rank, list(cmd.layout), cmd.rendezvous)
    if dp is not None and dp.sync_groups:
        plans = sealed_plans(sync_group_plans(dp), cmd.layout, cmd.rendezvous.data_plane_encrypt)
        grad_sync = GradientSync(bundle.layers, stage.layer_start, plans, make_groups(plans),
                                 wire_device(device, backend), cmd.rendezvous)
    executor = StageExecutor(bundle.layers, bundle.loss_fn, is_first=stage.stage_index == 0,
                             is_last=stage.stage_index == stage.num_stages - 1, device=device,
                             prev_link=prev_link, next_link=next_link, recipe=recipe_of(train),
                             sum_over_model=_sum_over_model(island, device, backend),
                             precision=train.precision or "fp32", link_rounding=train.link_rounding or DEFAULT_LINK_ROUNDING,
                             any_over_model=_any_over_model(island, device, backend),
                             emulation=emulated_speed(stage.emulate, train.start_step), grad_sync=grad_sync,
                             before_optimizer_step=_pipeline_barrier(dp, cmd.rendezvous.rank, device, backend,
                                                                                     list(cmd.layout), cmd.rendezvous),
                             memory=memory, eval_links=eval_links)
    executor.steps_done = train.start_step
    if bundle.tied:  # after every other group, in the same order on every rank
        executor.tied = TiedParameters(bundle.tied, list(cmd.layout), cmd.rendezvous.rank, executor.module,
                                       stage.layer_start, wire_device(device, backend), cmd.rendezvous)
        if restored is None:
            executor.tied.share_initial_values()
    outer_state: dict = {}
    if restored is not None:  # a checkpoint written with islands holds outer state too
        restored, outer_state = split_outer(restored)
        apply_state(executor.module, executor.optimizer, restored, stage.layer_start, resumed_step_of(train))
    # After the tied groups, by every rank; the anchor is the weights as they start (shared, restored)
    # unless the checkpoint kept it.
    executor.outer = _outer_sync(dp, list(cmd.layout), bundle, stage.layer_start, wire_device(device, backend),
                                 executor.state_lock, cmd.rendezvous)
    if executor.outer is not None:
        executor.outer.reset_anchor()
        executor.outer.load(executor.module, outer_state, stage.layer_start)
    return executor


def _least_transit(link: Link | None) -> pb.LinkTransit | None:
    """The step's least transit over `link` (then forgotten: each step reports its own)."""
    if link is None or link.least_transit is None:
        return None
    (seconds, wire_bytes), link.least_transit = link.least_transit, None
    return pb.LinkTransit(seconds=seconds, wire_bytes=wire_bytes)


def _train(cmd: pb.RunStage, executor: StageExecutor, batches: TokenBatches | None,
           eval_batches: TokenBatches | None, writer: CheckpointWriter | None, reports: StageReports,
           gate: MoveGate, running: RunningStage) -> None:
    """The steps, from train.start_step on: a live move when one is due, data, one schedule pass,
    a report, a checkpoint when due."""
    stage, train = cmd.stage, cmd.train
    spec = model_spec_from_proto(cmd.model)
    dp = cmd.data_parallel if cmd.HasField("data_parallel") else None
    global_microbatches = dp.global_microbatches if dp else train.num_microbatches
    # The loss is the mean over the micro-batches that sync every step: the island's (all, without islands).
    loss_divisor = dp.island_microbatches if dp and dp.island_microbatches else global_microbatches
    first_microbatch = dp.microbatch_offset if dp else 0
    actions = schedule_for(schedule_name(train.schedule), stage.stage_index, stage.num_stages, train.num_microbatches,
                           stage.window)
    evaluation = StepEvaluation(train, stage, executor, eval_batches, actions)
    tokens = train.micro_batch_size * train.num_microbatches * spec.seq_len
    evaluation.before_first_step(reports.step)
    for step in range(train.start_step, train.steps):
        move = gate.before_step(step)
        if move is not None:
            evaluation.before_move(reports.step)
            if writer is not None:
                writer.wait()  # the part being written holds the old range
            reports.move(move_stage(running, move))
        torch.manual_seed(step_rng_seed(train.seed, step))
        executor.wire.reseed(link_rounding_seed(train.seed, step, stage.stage_index))
        _emulate_at(executor, stage, step)
        microbatches = None
        if batches is not None:  # the step's global batch, of which this pipeline takes its share
            microbatches = batches.micro_batches(step, train.micro_batch_size, global_microbatches)
            microbatches = microbatches[first_microbatch:first_microbatch + train.num_microbatches]
        trace = [] if train.trace_every and step % train.trace_every == 0 else None
        try:
            step_actions, held_out = evaluation.step_actions()
            result = executor.train_step(step_actions, microbatches, loss_divisor, trace, held_out)
        except torch.OutOfMemoryError as err:
            if executor.memory is None or not executor.memory.limit_bytes:  # no limit of ours refused it
                raise
            raise executor.memory.out_of_memory(err, f"at step {step}") from None
        done = step + 1
        outer = None
        if executor.outer is not None:
            started = host_clock.now()
            outer = executor.outer.after_step(done)
            if done == train.steps:
                executor.outer.final(done, outer)  # the run ends on the anchor
            if trace is not None and (outer.launched or outer.applied):
                trace.append(("outer step", started, host_clock.now(), -1))
        evaluation.after_step(done, result.eval_loss, _step_metrics(
            step, stage, result, tokens, dp.pipeline_index if dp else 0, None, executor, trace, outer), reports.step)
        if writer is not None and checkpoint_due(train, done):
            writer.save(done)
    gate.finished(train.steps)
    if writer is not None:
        writer.wait()  # the last checkpoint is reported before the stage reports success


def _emulate_at(executor: StageExecutor, stage: pb.StageSpec, step: int) -> None:
    """The stage's emulated speed and its links' emulated bandwidth as of this step (YAML changes at a step)."""
    executor.emulation = emulated_speed(stage.emulate, step)
    for link, spec in ((executor.prev_link, stage.prev), (executor.next_link, stage.next)):
        if link is not None and link.emulation is not None:
            link.emulation.at_step(spec, step)


def _step_metrics(step: int, stage: pb.StageSpec, result, tokens: int, pipeline_index: int,
                  eval_loss: float | None, executor: StageExecutor, trace: list | None,
                  outer: OuterStats | None = None) -> pb.StepMetrics:
    outer = outer or OuterStats()
    memory = executor.memory
    return pb.StepMetrics(outer_launched=outer.launched, outer_applied=outer.applied, outer_s=outer.blocked_s,
                          outer_raw_bytes=outer.raw_bytes, outer_wire_bytes=outer.wire_bytes,
                          step=step, stage_index=stage.stage_index, has_loss=result.loss is not None,
                          loss=result.loss or 0.0, step_s=result.step_s, compute_s=result.compute_s,
                          comm_s=result.comm_s, tokens=tokens,
                          forward_raw_bytes=result.forward_bytes[0], forward_wire_bytes=result.forward_bytes[1],
                          backward_raw_bytes=result.backward_bytes[0], backward_wire_bytes=result.backward_bytes[1],
                          pipeline_index=pipeline_index, sync_s=result.sync_s,
                          sync_raw_bytes=result.sync_bytes[0], sync_wire_bytes=result.sync_bytes[1],
                          lr=result.lr, grad_norm=result.grad_norm, has_eval_loss=eval_loss is not None,
                          eval_loss=eval_loss or 0.0, from_prev=_least_transit(executor.prev_link),
                          from_next=_least_transit(executor.next_link),
                          peak_activation_bytes=memory.peak_activation_bytes if memory else 0,
                          peak_used_bytes=memory.peak_used_bytes if memory else 0,
                          trace=[pb.TraceEvent(name=name, start=start, end=end, microbatch=mb)
                                 for name, start, end, mb in trace or ()])
