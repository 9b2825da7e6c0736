"""The baseline of bench/overhead.py: a plain PyTorch training loop, one process, one thread.

    python bench/plain_loop_worker.py CONFIG_JSON OUT_JSON

Same model (every layer from build_model_range), same batches (TokenBatches), same
micro-batching (loss / M backward per micro-batch, AdamW step after M), timed the way
hetlaunch's executor times a step: from the first forward to the end of the optimizer
step, with the step's micro-batches drawn before the clock starts.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main(config_json: str, out_path: str) -> None:
    cfg = json.loads(config_json)
    torch.set_num_threads(1)
    from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
    from hetlaunch.runtime.model import build_model_range, count_layers
    from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec

    spec = ModelSpec(gpt=GPTConfig(**cfg["model"]))
    bundle = build_model_range(spec, 0, count_layers(spec), seed=cfg["seed"])
    model = torch.nn.Sequential(*bundle.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    batches = TokenBatches(stdlib_text_bytes(), spec.seq_len, seed=cfg["data_seed"])
    mbs, m = cfg["micro_batch_size"], cfg["num_microbatches"]
    step_s, losses = [], []
    for step in range(cfg["steps"]):
        microbatches = batches.micro_batches(step, mbs, m)
        start = time.perf_counter()
        step_losses = []
        for inputs, targets in microbatches:
            loss = bundle.loss_fn(model(inputs), targets)
            step_losses.append(loss.item())
            (loss / m).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
        losses.append(sum(step_losses) / m)
    with open(out_path, "w") as f:
        json.dump({"step_s": step_s, "loss": losses}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
