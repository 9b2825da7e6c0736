"""Turn a RunStage command into a running stage: model range, data, data-plane group, links, steps."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.codecs import codec_by_id
from hetlaunch.runtime.data_plane import init_data_plane, wire_device
from hetlaunch.runtime.devices import resolve_device
from hetlaunch.runtime.data import TokenBatches, file_text_bytes, stdlib_text_bytes
from hetlaunch.runtime.emulation import ComputeEmulation, WireEmulation
from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.grad_sync import GradientSync, SyncGroupPlan, make_groups
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.schedules import schedule_for
from hetlaunch.runtime.wire import model_spec_from_proto, schedule_name, sync_emulation_latency_ms


def _links(stage: pb.StageSpec, device: torch.device, backend: str) -> tuple[Link | None, Link | None]:
    wire = wire_device(device, backend)
    prev = next_ = None
    if stage.HasField("prev"):  # we send gradients back to the previous stage
        prev = Link(stage.prev.peer_rank, codec_by_id(stage.prev.backward_codec), device, wire,
                    emulation=WireEmulation.from_spec(stage.prev.emulate_bandwidth_mbps, stage.prev.emulate_latency_ms))
    if stage.HasField("next"):  # we send activations on to the next stage
        next_ = Link(stage.next.peer_rank, codec_by_id(stage.next.forward_codec), device, wire,
                     emulation=WireEmulation.from_spec(stage.next.emulate_bandwidth_mbps, stage.next.emulate_latency_ms))
    return prev, next_


def sync_group_plans(dp: pb.DataParallel) -> list[SyncGroupPlan]:
    plans = []
    for group in dp.sync_groups:
        codec = codec_by_id(group.codec)
        latency_ms = sync_emulation_latency_ms(group.emulate_latency_ms, codec.name, len(group.ranks))
        plans.append(SyncGroupPlan(group.layer_start, group.layer_end, tuple(group.ranks), codec,
                                   WireEmulation.from_spec(group.emulate_bandwidth_mbps, latency_ms)))
    return plans


def save_stage_checkpoint(module: torch.nn.Module, layer_start: int, stage_index: int, directory: str | Path) -> Path:
    """Parameters keyed by global layer index (`layers.<i>.<name>`), so stages merge into one model.

    Load with torch.load(path, weights_only=True); written to a temporary name first so a
    reader never sees half a file.
    """
    state = {f"layers.{layer_start + int(key.split('.', 1)[0])}.{key.split('.', 1)[1]}": value.detach().cpu()
             for key, value in module.state_dict().items()}
    path = Path(directory) / f"stage{stage_index}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def run_stage(cmd: pb.RunStage, report: Callable[[pb.StepMetrics], None]) -> None:
    """Train this node's stage for every step of the job; report one StepMetrics per step."""
    stage, train = cmd.stage, cmd.train
    if stage.threads:
        torch.set_num_threads(stage.threads)
    device = resolve_device(stage.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = model_spec_from_proto(cmd.model)
    bundle = build_model_range(spec, stage.layer_start, stage.layer_end, seed=train.seed)
    is_first = stage.stage_index == 0
    is_last = stage.stage_index == stage.num_stages - 1
    if is_last and stage.layer_end != bundle.num_layers:  # the loss belongs after the model's last layer
        raise ValueError(f"the last stage ends at layer {stage.layer_end}, but the model has {bundle.num_layers} "
                         f"layers: the pinned layers must cover [0, {bundle.num_layers})")
    batches = None
    if is_first or is_last:  # middle stages never touch the data
        text = file_text_bytes(cmd.data.path) if cmd.data.path else stdlib_text_bytes()
        batches = TokenBatches(text, spec.seq_len, seed=cmd.data.seed)
    dp = cmd.data_parallel if cmd.HasField("data_parallel") else None
    global_microbatches = dp.global_microbatches if dp else train.num_microbatches
    first_microbatch = dp.microbatch_offset if dp else 0
    init_data_plane(cmd.rendezvous)
    try:
        prev_link, next_link = _links(stage, device, cmd.rendezvous.backend)
        grad_sync = None
        if dp is not None and dp.sync_groups:
            plans = sync_group_plans(dp)
            grad_sync = GradientSync(bundle.layers, stage.layer_start, plans, make_groups(plans),
                                     wire_device(device, cmd.rendezvous.backend))
        executor = StageExecutor(bundle.layers, bundle.loss_fn, is_first=is_first, is_last=is_last, device=device,
                                 prev_link=prev_link, next_link=next_link, lr=train.lr,
                                 weight_decay=train.weight_decay,
                                 emulation=ComputeEmulation(stage.emulate.speed or 1.0), grad_sync=grad_sync)
        actions = schedule_for(schedule_name(train.schedule), stage.stage_index, stage.num_stages,
                               train.num_microbatches)
        tokens = train.micro_batch_size * train.num_microbatches * spec.seq_len
        for step in range(train.steps):
            microbatches = None
            if batches is not None:  # the step's global batch, of which this pipeline takes its share
                microbatches = batches.micro_batches(step, train.micro_batch_size, global_microbatches)
                microbatches = microbatches[first_microbatch:first_microbatch + train.num_microbatches]
            result = executor.train_step(actions, microbatches, global_microbatches)
            report(pb.StepMetrics(step=step, stage_index=stage.stage_index, has_loss=result.loss is not None,
                                  loss=result.loss or 0.0, step_s=result.step_s, compute_s=result.compute_s,
                                  comm_s=result.comm_s, tokens=tokens,
                                  forward_raw_bytes=result.forward_bytes[0], forward_wire_bytes=result.forward_bytes[1],
                                  backward_raw_bytes=result.backward_bytes[0],
                                  backward_wire_bytes=result.backward_bytes[1],
                                  pipeline_index=dp.pipeline_index if dp else 0, sync_s=result.sync_s,
                                  sync_raw_bytes=result.sync_bytes[0], sync_wire_bytes=result.sync_bytes[1]))
        if train.checkpoint_dir:
            # Several pipelines hold identical replicas; each saves its own, under pipeline<p>/.
            directory = Path(train.checkpoint_dir) / (f"pipeline{dp.pipeline_index}" if dp else "")
            save_stage_checkpoint(executor.module, stage.layer_start, stage.stage_index, directory)
    finally:
        dist.destroy_process_group()
