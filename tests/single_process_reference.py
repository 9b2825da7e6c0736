"""A single-process reference for the multi-process equivalence tests (test_pipeline_equivalence,
test_data_parallel): the built-in GPT trained whole, on the same batches, seed and recipe, with
the learning-rate schedule written out here rather than taken from runtime/optim.py."""

from __future__ import annotations

import math

import torch

from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
from hetlaunch.runtime.model import build_model_range, count_layers
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec

STEPS = 6
MICRO_BATCH, NUM_MICRO = 2, 4
LR, WEIGHT_DECAY, SEED, DATA_SEED = 3e-3, 0.01, 7, 3
# The recipe under test: warm-up then cosine decay, and a clip low enough to act on every step.
WARMUP, MIN_LR_RATIO, CLIP = 2, 0.1, 0.05
RECIPE = f"lr_schedule: cosine, warmup_steps: {WARMUP}, min_lr_ratio: {MIN_LR_RATIO}, grad_clip: {CLIP}"
CFG = GPTConfig(seq_len=16, d_model=32, n_layers=6, n_heads=4)  # 8 stage layers



def reference_lr(step: int) -> float:
    """Linear warm-up, then cosine down to LR * MIN_LR_RATIO at the last step (written out here,
    not taken from runtime/optim.py, so a wrong schedule there fails this test)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    floor = LR * MIN_LR_RATIO
    return floor + (LR - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def reference_training() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    spec = ModelSpec(gpt=CFG)
    bundle = build_model_range(spec, 0, count_layers(spec), seed=SEED)
    model = torch.nn.Sequential(*bundle.layers)
    # Weight decay on matrices and embeddings only, never on biases or LayerNorm gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    batches = TokenBatches(stdlib_text_bytes(), CFG.seq_len, seed=DATA_SEED)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for inputs, targets in batches.micro_batches(step, MICRO_BATCH, NUM_MICRO):
            loss = bundle.loss_fn(model(inputs), targets)
            (loss / NUM_MICRO).backward()
            step_losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # the clip acts on every step: the test covers it
        for group in optimizer.param_groups:
            group["lr"] = reference_lr(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / NUM_MICRO)
    params = {f"layers.{k}": v.detach() for k, v in model.state_dict().items()}
    return losses, params
