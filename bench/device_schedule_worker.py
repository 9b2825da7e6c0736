"""One rank of bench/vs_torch_device_schedules.py: two stages per rank, run by hetlaunch's executor
or by torch.distributed.pipelining, on the same model, cut, weights, batches and micro-batches.

    python bench/device_schedule_worker.py CONFIG_JSON RANK STORE_PORT OUT_JSON

CONFIG_JSON names the side ("hetlaunch" or "torch") and the schedule ("interleaved-1f1b": torch's
ScheduleInterleaved1F1B, the looping placement; "zb-v": ScheduleZBVZeroBubble, the V placement).
Each rank builds its stages' layer ranges with hetlaunch's build_model_range (the same weights
either side), then steps AdamW. hetlaunch's side is its StageExecutor holding StageParts: links
between ranks (a tag per boundary), the in-device hand-off of a V's middle stages, the order of
runtime/device_schedules.py, host memory kept from step to step as a stage worker keeps it
(runtime/host_allocator.py). torch's side is PipelineStage x 2 with its schedule (scale_grads: the
gradient of the mean loss, as hetlaunch's loss / M). A step is timed from the schedule's start to
the end of the optimizer step, the batch drawn first.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main(config_json: str, rank: int, store_port: int, out_path: str) -> None:
    cfg = json.loads(config_json)
    if cfg["side"] == "hetlaunch":
        # As a stage worker starts (runtime/worker.py), before anything allocates: what users get.
        from hetlaunch.runtime.host_allocator import tune_host_allocator
        tune_host_allocator()
    torch.set_num_threads(1)
    from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
    from hetlaunch.runtime.device_schedules import device_schedule_named
    from hetlaunch.runtime.model import build_model_range
    from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec

    devices = cfg["devices"]
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=devices, timeout=timeout)
    try:
        spec = ModelSpec(gpt=GPTConfig(**cfg["model"]))
        placed = device_schedule_named(cfg["schedule"])
        num_stages = placed.num_stages(devices)
        mine = placed.device_stages(rank, devices)
        bundles = {s: build_model_range(spec, *cfg["ranges"][s], seed=cfg["seed"]) for s in mine}
        m = cfg["num_microbatches"]
        holds_data = 0 in mine or num_stages - 1 in mine
        batches = TokenBatches(stdlib_text_bytes(), spec.seq_len, seed=cfg["data_seed"]) if holds_data else None
        run = _hetlaunch if cfg["side"] == "hetlaunch" else _torch
        step_s, losses = run(cfg, rank, placed, mine, bundles, batches, num_stages, m)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "step_s": step_s, "loss": losses}, f)


def _hetlaunch(cfg, rank, placed, mine, bundles, batches, num_stages, m):
    from hetlaunch.runtime.codecs import codec_by_name
    from hetlaunch.runtime.executor import StageExecutor, StagePart
    from hetlaunch.runtime.link import Link
    from hetlaunch.runtime.local_link import local_boundary
    from hetlaunch.runtime.optim import Recipe

    cpu, devices = torch.device("cpu"), cfg["devices"]
    where = [placed.stage_device(s, devices) for s in range(num_stages)]
    local: dict[int, tuple] = {}

    def link(boundary: int, toward: int):
        if where[boundary] == where[boundary + 1]:
            ends = local.setdefault(boundary, local_boundary(boundary))
            return ends[0] if toward == boundary + 1 else ends[1]
        return Link(where[toward], codec_by_name("none"), cpu, cpu, tag=boundary)

    parts = [StagePart(s, len(bundles[s].layers), None if s == 0 else link(s - 1, s - 1),
                       None if s == num_stages - 1 else link(s, s + 1)) for s in mine]
    layers = [layer for s in mine for layer in bundles[s].layers]
    loss_fn = bundles[mine[-1]].loss_fn
    executor = StageExecutor(layers, loss_fn, is_first=False, is_last=False, device=cpu, parts=parts,
                             recipe=Recipe(lr=cfg["lr"], weight_decay=cfg["weight_decay"]))
    actions = placed.actions(devices, m)[rank]
    step_s, losses = [], []
    for step in range(cfg["steps"]):
        microbatches = None
        if batches is not None:
            inputs, targets = batches.batch(step, cfg["micro_batch_size"] * m)
            microbatches = list(zip(inputs.chunk(m), targets.chunk(m)))
        t0 = time.perf_counter()
        result = executor.train_step(actions, microbatches, m)
        step_s.append(time.perf_counter() - t0)
        if result.loss is not None:
            losses.append(result.loss)
    return step_s, losses


def _torch(cfg, rank, placed, mine, bundles, batches, num_stages, m):
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    cpu = torch.device("cpu")
    modules = {s: torch.nn.Sequential(*bundles[s].layers) for s in mine}
    stages = [PipelineStage(modules[s], s, num_stages, cpu) for s in mine]
    kind = {"interleaved-1f1b": ScheduleInterleaved1F1B, "zb-v": ScheduleZBVZeroBubble}[cfg["schedule"]]
    loss_fn = bundles[mine[-1]].loss_fn  # every rank passes one: that is how a schedule knows it has a backward
    schedule = kind(stages, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
    params = [p for s in mine for p in modules[s].parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    first, last = 0 in mine, num_stages - 1 in mine
    step_s, losses = [], []
    for step in range(cfg["steps"]):
        if batches is not None:
            inputs, targets = batches.batch(step, cfg["micro_batch_size"] * m)
        mb_losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if first and last:
            schedule.step(inputs, target=targets, losses=mb_losses, return_outputs=False)
        elif first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=targets, losses=mb_losses, return_outputs=False)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        if last:
            losses.append(sum(x.detach().item() for x in mb_losses) / m)
    return step_s, losses


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
