"""The training recipe a stage applies to its own layers: the optimizer (AdamW or SGD with
momentum, weight decay only on weights of two or more dimensions), the learning rate at each step
(warm-up, then constant, cosine or linear decay), and gradient clipping by the norm of the whole
model's gradient, summed over every stage of every pipeline as `clip_grad_norm_` would in one
process.

The schedule is a pure function of the step, so a run resumed at step k, on any cut, uses the
learning rate an uninterrupted run uses; nothing about it needs saving.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class Recipe:
    lr: float = 3e-3
    weight_decay: float = 0.0
    optimizer: str = "adamw"
    momentum: float = 0.9            # SGD only
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1        # the decay ends at lr * min_lr_ratio
    total_steps: int = 1             # the decay spans warm-up end .. total_steps
    grad_clip: float = 0.0           # 0: no clipping

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r} (known: {', '.join(OPTIMIZERS)})")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r} (known: {', '.join(LR_SCHEDULES)})")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): linear warm-up over warmup_steps
        (step 0 already takes lr / warmup_steps), then the schedule down to lr * min_lr_ratio."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * self.min_lr_ratio
        if self.lr_schedule == "linear":
            return self.lr - (self.lr - floor) * progress
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or norm gains (nanoGPT, Megatron)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [group for group in ({"params": decay, "weight_decay": weight_decay},
                                {"params": rest, "weight_decay": 0.0}) if group["params"]]


def make_optimizer(module: nn.Module, recipe: Recipe) -> torch.optim.Optimizer | None:
    """None for a stage with no trainable parameters (it has nothing to step)."""
    groups = parameter_groups(module, recipe.weight_decay)
    if not groups:
        return None
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=recipe.lr, momentum=recipe.momentum)
    return torch.optim.AdamW(groups, lr=recipe.lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(module: nn.Module, max_norm: float,
                   sum_over_model: Callable[[torch.Tensor], torch.Tensor], exclude: set[int] = frozenset()) -> float:
    """Scale this stage's gradients so the whole model's gradient norm is at most max_norm;
    returns that norm (before clipping). `sum_over_model` turns this stage's sum of squares into
    the whole model's (an all-reduce over the stages; identity in one process). Parameters in
    `exclude` (ids: copies of a tied parameter) are scaled but not counted again."""
    params = [p for p in module.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    local = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for p in params:
        if id(p) not in exclude:
            local = local + p.grad.detach().float().pow(2).sum()
    total = float(sum_over_model(local)) ** 0.5
    coef = max_norm / (total + 1e-6)  # as torch.nn.utils.clip_grad_norm_
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
