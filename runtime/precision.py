"""Mixed precision for a stage: `train.precision: fp32 | bf16 | fp16`.

Weights and optimizer state stay fp32 (the master copy); forwards run under autocast in the
compute dtype; activations and their gradients cross links in the compute dtype (half the
bytes of fp32, before any codec), and the receiving stage goes on from an fp32 copy, as one
process's residual stream would. fp16 also needs loss scaling: the last stage multiplies its
loss by the scale, every stage divides its gradients by it before clipping and stepping, and
the decision to skip a step (some gradient overflowed) and to change the scale is taken from
every stage's overflow flag at once, so all stages keep one scale and skip the same steps.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16", "fp16")
_COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype, or None for fp32."""
    if precision not in _COMPUTE_DTYPES:
        raise ValueError(f"unknown precision {precision!r} (known: {', '.join(PRECISIONS)})")
    return _COMPUTE_DTYPES[precision]


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What a stage sends of a floating-point activation: the compute dtype (a differentiable
    cast, so the gradient that comes back is in it too)."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def from_wire(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """What a stage computes on from a received activation: fp32 again."""
    if dtype is None or tensor.dtype != dtype:
        return tensor
    return tensor.float()


class LossScaler:
    """A dynamic loss scale kept identical on every stage: `unscale` divides this stage's
    gradients and says whether any is not finite; `update` takes the flag of the whole model
    (any stage), halves the scale on an overflow (the step is skipped) and doubles it after
    `growth_interval` clean steps, as torch.amp.GradScaler does in one process."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def unscale(self, module: nn.Module) -> bool:
        """Divide the gradients by the scale; True if any is inf or nan."""
        overflow = False
        inv = 1.0 / self.scale
        for p in module.parameters():
            if p.grad is not None:
                p.grad.mul_(inv)
                if not overflow and not bool(torch.isfinite(p.grad).all()):
                    overflow = True
        return overflow

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale * 0.5, 1.0)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval and math.isfinite(self.scale * 2):
            self.scale *= 2.0
            self._clean_steps = 0
