"""Turn a RunStage whose StageSpec holds several parts (interleaved 1F1B, ZB-V) into a running device:
one executor over all the node's stages, one optimizer, a link per boundary.

The node is one data-plane rank, device `stage.device_index` of `stage.num_devices`, and runs its
own list of the schedule's actions (runtime/device_schedules.py), which name their stage. Each
part is a StagePart of the executor (runtime/executor.py): the next layers of the executor's, in
pipeline order, with the links to the stages before and after it:

* where that stage is on another node, a Link to that node's rank, tagged with the boundary's
  index, so two boundaries between the same two nodes (ZB-V's 0-1 and 2-3) never take each other's
  messages; on NCCL, which ignores tags, each such boundary gets a process group of its own;
* where it is on this node too, the two ends of an in-memory hand-off (runtime/local_link.py).

The node holding the first stage reads the inputs, the one holding the last the targets and
reports the loss (under ZB-V both are device 0). Checkpoints are one part per stage, each its
own layer range (runtime/checkpoint.py write_part), so a checkpoint is per layer as with one
stage per node and can be resumed on any cut.

Several pipelines (RunStage.data_parallel) run as with one stage per node: each pipeline's nodes
are ranks of their own, each takes its share of the step's global batch with the loss over the
global count, and a node's layers, not contiguous in the model, sum their gradients with their
holders in the other pipelines (runtime/grad_sync.py, by layer index) before a barrier of the
pipeline and the optimizer step. Tied parameters (an embedding and the output projection) are
summed among their holders in each pipeline as with one stage per node (runtime/tied.py); under
ZB-V both ends of the model are on the first node, so in its process. A sampled step's trace is
the node's: its stages' actions in the order it ran them (one track per node in trace.json).

What runs with one stage per node only (live moves, islands, evaluation in the bubbles) is
refused before launch (launcher/device_schedule_checks.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.checkpoint import apply_state, load_layers, resumed_step_of, split_outer, stage_state
from hetlaunch.runtime.checkpoint_manifest import read_manifest
from hetlaunch.runtime.checkpoint_writer import CheckpointWriter
from hetlaunch.runtime.codecs import codec_by_id
from hetlaunch.runtime.data import open_data
from hetlaunch.runtime.data_plane import init_data_plane, wire_device
from hetlaunch.runtime.device_schedules import device_schedule_named, reordered
from hetlaunch.runtime.devices import resolve_device
from hetlaunch.runtime.emulation import WireEmulation, emulated_speed
from hetlaunch.runtime.executor import StageExecutor, StagePart
from hetlaunch.runtime.grad_sync import GradientSync, make_groups, sealed_plans, sync_group_plans
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.local_link import local_boundary
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.sealing import SealingError
from hetlaunch.runtime.stage_command import (Island, StageReports, _any_over_model, _named_refusal,
                                             _pipeline_barrier, _sealing, _stage_memory, _step_metrics,
                                             _sum_over_model, checkpoint_due, link_rounding_seed, recipe_of,
                                             step_rng_seed)
from hetlaunch.runtime.step_evaluation import StepEvaluation
from hetlaunch.runtime.tied import TiedParameters
from hetlaunch.runtime.registry import DEFAULT_LINK_ROUNDING
from hetlaunch.runtime.wire import model_spec_from_proto, schedule_name


def run_device_stages(cmd: pb.RunStage, reports: StageReports, store: wpb.StoreAccess) -> None:
    """Train this node's stages from train.start_step to the last step; one StepMetrics per step."""
    stage, train = cmd.stage, cmd.train
    if stage.threads:
        torch.set_num_threads(stage.threads)
    device = resolve_device(stage.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = model_spec_from_proto(cmd.model)
    parts = sorted(stage.parts, key=lambda p: p.stage_index)
    memory = _stage_memory(stage, device)  # before building: on CUDA the allocator's cap must be in place first
    bundles = [build_model_range(spec, p.layer_start, p.layer_end, seed=train.seed) for p in parts]
    bundle = bundles[0]
    if parts[-1].stage_index == stage.num_stages - 1 and parts[-1].layer_end != bundle.num_layers:
        raise ValueError(f"the last stage ends at layer {parts[-1].layer_end}, but the model has "
                         f"{bundle.num_layers} layers")
    restored = None
    if cmd.HasField("restore"):  # read before joining the group: a bad checkpoint fails this node alone
        directory = Path(cmd.restore.checkpoint_dir)
        manifest = read_manifest(directory)
        restored = [load_layers(directory, manifest, p.layer_start, p.layer_end) for p in parts]
    ends = parts[0].stage_index == 0 or parts[-1].stage_index == stage.num_stages - 1
    batches = eval_batches = None
    if ends:  # a node holding neither end never touches the data
        d = cmd.data
        batches, eval_batches = open_data(d.path, d.format, d.dtype, spec.seq_len, d.seed, bundle.vocab_size,
                                          d.eval_fraction if train.eval_every else 0.0)
    init_data_plane(cmd.rendezvous, store)
    executor = None
    try:
        layers = _LayerMap(parts)
        executor = _executor(cmd, parts, [layer for b in bundles for layer in b.layers], bundle.loss_fn, device,
                             memory, layers)
        if bundle.tied:  # after every other group, in the same order on every rank (runtime/tied.py)
            executor.tied = TiedParameters(bundle.tied, list(cmd.layout), cmd.rendezvous.rank, executor.module, 0,
                                           wire_device(device, cmd.rendezvous.backend), cmd.rendezvous,
                                           local_index=lambda index: layers.local_of[index])
        if restored is not None:  # a checkpoint written with islands also holds outer state: not ours to use
            apply_state(executor.module, executor.optimizer, split_outer(layers.to_local(restored))[0], 0,
                        resumed_step_of(train))
        elif executor.tied is not None:
            executor.tied.share_initial_values()
        writer = (CheckpointWriter(executor.state_lock, lambda: layers.split(stage_state(executor.module, executor.optimizer, 0)),
                                   train.checkpoint_dir, reports)
                  if train.checkpoint_dir and train.checkpoint_every and train.save_part else None)
        try:
            _train(cmd, executor, batches, eval_batches, writer, reports)
        except SealingError as err:
            raise _named_refusal(err, cmd.layout) from None
    finally:
        if executor is None or not executor.stop_receiving():
            dist.destroy_process_group()


def _executor(cmd: pb.RunStage, parts: list[pb.StagePartSpec], layers: list, loss_fn, device: torch.device,
              memory, layer_map: _LayerMap) -> StageExecutor:
    """The node's executor on the data plane just joined. Every rank makes the same process groups
    in the same order (c10d requires it): NCCL's per boundary, the island's, the gradient sync's,
    the pipelines' barriers; the tied parameters' come after, in run_device_stages."""
    stage, rdzv, train = cmd.stage, cmd.rendezvous, cmd.train
    dp = cmd.data_parallel if cmd.HasField("data_parallel") else None
    wire = wire_device(device, rdzv.backend)
    mine = next(place.pipeline for place in cmd.layout if place.rank == rdzv.rank)
    groups = {}
    if rdzv.backend == "nccl":  # NCCL ignores tags: a group per boundary between two nodes, made by every rank in order
        for pipeline in sorted({place.pipeline for place in cmd.layout}):
            # the layout lists each pipeline's stages in order
            rank_of_stage = [place.rank for place in cmd.layout if place.pipeline == pipeline]
            for b in range(len(rank_of_stage) - 1):
                if rank_of_stage[b] != rank_of_stage[b + 1]:
                    group = dist.new_group(sorted({rank_of_stage[b], rank_of_stage[b + 1]}))
                    if pipeline == mine:
                        groups[b] = group
    local: dict[int, tuple] = {}  # boundary -> its two in-memory ends

    def link(spec: pb.LinkSpec, boundary: int, upstream: bool):
        """This side of `boundary`: the upstream stage's next link, or the downstream stage's previous."""
        if spec.peer_rank == rdzv.rank:
            ends = local.setdefault(boundary, local_boundary(boundary))
            return ends[0] if upstream else ends[1]
        codec = spec.forward_codec if upstream else spec.backward_codec
        return Link(spec.peer_rank, codec_by_id(codec), device, wire,
                    emulation=WireEmulation.from_spec(spec.emulate_bandwidth_mbps, spec.emulate_latency_ms,
                                                      bool(spec.bandwidth_changes)),
                    max_message_bytes=spec.max_message_bytes, sealing=_sealing(spec, rdzv, f"link {boundary}"),
                    tag=boundary, group=groups.get(boundary))

    stage_parts = [StagePart(p.stage_index, p.layer_end - p.layer_start,
                             link(p.prev, p.stage_index - 1, False) if p.HasField("prev") else None,
                             link(p.next, p.stage_index, True) if p.HasField("next") else None) for p in parts]
    # One entry per rank: the island's members (its clipping norm and fp16 flag sum over all of them;
    # with several pipelines the norm is divided by their count, as every pipeline holds the model).
    ranks = {place.rank: place for place in cmd.layout}
    island = Island(dp, rdzv.rank, list(ranks.values()), rdzv)
    grad_sync = None
    if dp is not None and dp.sync_groups:  # a group's ranks are its holders' nodes
        plans = sealed_plans(sync_group_plans(dp), cmd.layout, rdzv.data_plane_encrypt)
        grad_sync = GradientSync(layers, 0, plans, make_groups(plans), wire, rdzv,
                                 local_index=layer_map.local_of.__getitem__)
    barrier = _pipeline_barrier(dp, rdzv.rank, device, rdzv.backend, list(ranks.values()), rdzv)
    executor = StageExecutor(layers, loss_fn, is_first=False, is_last=False, device=device, parts=stage_parts,
                             recipe=recipe_of(train), sum_over_model=_sum_over_model(island, device, rdzv.backend),
                             precision=train.precision or "fp32", link_rounding=train.link_rounding or DEFAULT_LINK_ROUNDING,
                             any_over_model=_any_over_model(island, device, rdzv.backend),
                             emulation=emulated_speed(stage.emulate, train.start_step), memory=memory,
                             grad_sync=grad_sync, before_optimizer_step=barrier)
    executor.steps_done = train.start_step
    return executor


class _LayerMap:
    """The executor's layers are the parts' ranges one after another; checkpoints name global layers."""

    def __init__(self, parts: list[pb.StagePartSpec]):
        self.ranges = [(p.layer_start, p.layer_end) for p in parts]
        self.global_of = [layer for start, end in self.ranges for layer in range(start, end)]
        self.local_of = {g: i for i, g in enumerate(self.global_of)}

    @staticmethod
    def _renumber(state: dict, index_map) -> dict:
        out = {}
        for key, tensor in state.items():
            kind, index, rest = key.split(".", 2)  # "layers.<i>.<name>", "optim.<i>.<name>.<field>"
            out[f"{kind}.{index_map(int(index))}.{rest}"] = tensor
        return out

    def to_local(self, per_part: list[dict]) -> dict:
        """The parts' restored states (global keys) as one state of the executor's module."""
        merged = {k: v for state in per_part for k, v in state.items()}
        return self._renumber(merged, lambda g: self.local_of[g])

    def split(self, state: dict) -> list[tuple[int, int, dict]]:
        """The executor's state (local keys) as (layer_start, layer_end, state with global keys) per part."""
        global_state = self._renumber(state, lambda i: self.global_of[i])
        return [(start, end, {k: v for k, v in global_state.items() if start <= int(k.split(".", 2)[1]) < end})
                for start, end in self.ranges]


def _train(cmd: pb.RunStage, executor: StageExecutor, batches, eval_batches, writer: CheckpointWriter | None,
           reports: StageReports) -> None:
    """The steps, from train.start_step on: data, one pass of this device's actions, a report, a
    checkpoint when due. Evaluation, when due, runs after the step (StageSpec.eval_fill is empty)."""
    stage, train = cmd.stage, cmd.train
    spec = model_spec_from_proto(cmd.model)
    dp = cmd.data_parallel if cmd.HasField("data_parallel") else None
    # Several pipelines: this one's share of the step's global batch, each loss over the global count.
    global_microbatches = dp.global_microbatches if dp else train.num_microbatches
    first_microbatch = dp.microbatch_offset if dp else 0
    placed = device_schedule_named(schedule_name(train.schedule))
    actions = placed.actions(stage.num_devices, train.num_microbatches)[stage.device_index]
    if stage.device_order:  # the order the planner priced (ZB-V's built at the stages' costs)
        actions = reordered(actions, stage.device_order, train.num_microbatches)
    evaluation = StepEvaluation(train, stage, executor, eval_batches, actions)
    tokens = train.micro_batch_size * train.num_microbatches * spec.seq_len
    links = [(link, spec) for part, p in zip(executor.parts, sorted(stage.parts, key=lambda p: p.stage_index))
             for link, spec in ((part.prev_link, p.prev), (part.next_link, p.next)) if isinstance(link, Link)]
    for step in range(train.start_step, train.steps):
        torch.manual_seed(step_rng_seed(train.seed, step))
        # one rounding stream for the node's executor (all its stages' links), its own per step
        executor.wire.reseed(link_rounding_seed(train.seed, step, stage.device_index))
        executor.emulation = emulated_speed(stage.emulate, step)
        for link, link_spec in links:  # a link's emulated bandwidth as the YAML changes it at a step
            if link.emulation is not None:
                link.emulation.at_step(link_spec, step)
        microbatches = None
        if batches is not None:
            microbatches = batches.micro_batches(step, train.micro_batch_size, global_microbatches)
            microbatches = microbatches[first_microbatch:first_microbatch + train.num_microbatches]
        sent_before = _sent_by_part(executor)
        # a sampled step's timeline: the node's one track, its stages' actions in the order it ran them
        trace = [] if train.trace_every and step % train.trace_every == 0 else None
        try:
            result = executor.train_step(actions, microbatches, global_microbatches, trace)
        except torch.OutOfMemoryError as err:
            if executor.memory is None or not executor.memory.limit_bytes:
                raise
            raise executor.memory.out_of_memory(err, f"at step {step}") from None
        done = step + 1
        metrics = _step_metrics(step, stage, result, tokens, dp.pipeline_index if dp else 0, None, executor, trace)
        for part, before, after in zip(executor.parts, sent_before, _sent_by_part(executor)):
            metrics.parts.add(stage_index=part.stage_index, compute_s=result.part_compute_s.get(part.stage_index, 0.0),
                              forward_raw_bytes=after[0] - before[0], forward_wire_bytes=after[1] - before[1],
                              backward_raw_bytes=after[2] - before[2], backward_wire_bytes=after[3] - before[3])
        evaluation.after_step(done, result.eval_loss, metrics, reports.step)
        if writer is not None and checkpoint_due(train, done):
            writer.save(done)
    if writer is not None:
        writer.wait()  # the last checkpoint is reported before the node reports success


def _sent_by_part(executor: StageExecutor) -> list[tuple[int, int, int, int]]:
    """Bytes each part has sent so far, (raw, wire) forward then backward: a node reports its step
    per stage too (StepMetrics.parts). An in-memory hand-off counts no bytes."""
    def sent(link) -> tuple[int, int]:
        return (link.stats.raw_bytes, link.stats.wire_bytes) if isinstance(link, Link) else (0, 0)
    return [(*sent(part.next_link), *sent(part.prev_link)) for part in executor.parts]
