"""The baseline of bench/vs_torch_pipelining.py: one rank of a torch.distributed.pipelining job.

    python bench/torch_pipelining_worker.py CONFIG_JSON RANK STORE_PORT OUT_JSON

Each rank builds its layer range with hetlaunch's build_model_range (the same weights a
hetlaunch stage builds), wraps it in nn.Sequential and a PipelineStage, and runs
Schedule1F1B over gloo, then an AdamW step. The loss is hetlaunch's (mean cross entropy
per micro-batch); scale_grads=True makes torch divide the accumulated gradients by the
number of micro-batches once after the last backward, which is the same gradient
hetlaunch gets by backpropagating loss / M per micro-batch.

A step is timed as hetlaunch's executor times one: from the schedule's start to the
end of the optimizer step, with the step's batch drawn before the clock starts.
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
    torch.set_num_threads(1)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
    from hetlaunch.runtime.model import build_model_range
    from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec

    world = len(cfg["ranges"])
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        spec = ModelSpec(gpt=GPTConfig(**cfg["model"]))
        start, end = cfg["ranges"][rank]
        bundle = build_model_range(spec, start, end, seed=cfg["seed"])
        module = torch.nn.Sequential(*bundle.layers)
        is_first, is_last = rank == 0, rank == world - 1
        m = cfg["num_microbatches"]
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        # Every rank passes loss_fn (that is how a schedule knows it has a backward); only the last computes it.
        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=bundle.loss_fn, scale_grads=True)
        optimizer = torch.optim.AdamW(module.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
        batches = TokenBatches(stdlib_text_bytes(), spec.seq_len, seed=cfg["data_seed"]) if is_first or is_last else None
        step_s, losses = [], []
        for step in range(cfg["steps"]):
            if batches is not None:
                # The same global batch hetlaunch cuts into micro-batches; torch cuts it the same way (chunks on dim 0).
                inputs, targets = batches.batch(step, cfg["micro_batch_size"] * m)
            t0 = time.perf_counter()
            if is_first:
                schedule.step(inputs)
            elif is_last:
                mb_losses: list[torch.Tensor] = []
                schedule.step(target=targets, losses=mb_losses, return_outputs=False)
            else:
                schedule.step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_s.append(time.perf_counter() - t0)
            if is_last:
                losses.append(sum(x.detach().item() for x in mb_losses) / m)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "step_s": step_s, "loss": losses}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
