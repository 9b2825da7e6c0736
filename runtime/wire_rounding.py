"""How a bf16 stage rounds the activations and gradients that cross its links.

A stage computes under autocast but keeps its residual stream in fp32 (the adds promote), so
within a stage the stream accumulates small updates exactly enough; a link carries the compute
dtype, half the bytes. Two ways to round onto a link:

- `nearest` (the default): the stream is rounded to the nearest bf16 at every boundary. Biased,
  but with no noise of its own. On the tiny preset cut into 3 stages, 400 steps with a cosine
  decay (bench/precision.py), it ended 0.1% above fp32's loss over 5 seeds, every seed within 1%.
- `stochastic`: a value is rounded up with the probability of its distance from the lower
  neighbour, so the expected value crossing the link is the fp32 one (Gupta et al., "Deep
  learning with limited numerical precision", 2015). Unbiased, but the rounding noise it adds
  at every boundary cost more than the bias saved: 1.6% above fp32 over the same seeds, 4.9% on one. (It was
  the default while the bench compared final losses at a constant learning rate, where a run's
  plateau, not its rounding, set the figure.) Forward activations are rounded so by the sender,
  the gradients going back by the receiver, each from a generator of the stage's own, seeded
  per step, so a run repeats bit for bit and dropout's random stream is untouched.

`train.link_rounding` applies to bf16 only: fp16's narrower exponent is not a truncation of
fp32's bits, and fp16 keeps nearest. Evaluation forwards always round to nearest: the held-out
loss must not depend on where in the step it ran.
"""

from __future__ import annotations

import torch

from hetlaunch.runtime.precision import from_wire, to_wire
from hetlaunch.runtime.registry import LINK_ROUNDINGS



def stochastic_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x rounded to bf16 stochastically: random bits added below bf16's last mantissa bit of the
    fp32 pattern, then cut off (a carry rounds up). Exact values stay exact; inf stays inf."""
    x = x.float().contiguous()
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class _SendRounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        ctx.dtype = x.dtype
        return stochastic_bf16(x, generator)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class _ReceiveRounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wire: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        ctx.generator = generator
        return wire.float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return stochastic_bf16(grad, ctx.generator), None


class WireRounding:
    """A stage's casts at its links for training: `send` for an activation going out (its
    gradient comes back in the wire dtype), `receive` for one coming in (its gradient goes back
    rounded)."""

    def __init__(self, dtype: torch.dtype | None, mode: str, device: torch.device):
        if mode not in LINK_ROUNDINGS:
            raise ValueError(f"unknown link rounding {mode!r} (known: {', '.join(LINK_ROUNDINGS)})")
        self.dtype = dtype
        self.generator = torch.Generator(device=device) if mode == "stochastic" and dtype == torch.bfloat16 else None

    def reseed(self, seed: int) -> None:
        """At the start of each step: the same step draws the same rounding, after a restore too."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    def send(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.generator is None or not tensor.is_floating_point() or tensor.dtype == self.dtype:
            return to_wire(tensor, self.dtype)
        return _SendRounded.apply(tensor, self.generator)

    def receive(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.generator is None or tensor.dtype != self.dtype:
            return from_wire(tensor, self.dtype)
        return _ReceiveRounded.apply(tensor, self.generator)
