"""What crosses a stage boundary: one tensor, or a tuple of tensors (a hidden state with its
mask, position ids, a router loss...). A layer's output, whichever it is, is the next layer's one
argument. Gradients travel back for the floating-point (and complex) elements only, in order;
integer and boolean elements (masks, ids) have none."""

from __future__ import annotations

from typing import Callable

import torch

Message = torch.Tensor | tuple[torch.Tensor, ...]


def tensors(message: Message) -> tuple[torch.Tensor, ...]:
    if isinstance(message, torch.Tensor):
        return (message,)
    if isinstance(message, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in message):
        return tuple(message)
    raise TypeError(f"a layer's output must be a tensor or a tuple of tensors, got {type(message).__name__}")


def differentiable(message: Message) -> list[torch.Tensor]:
    """The elements that carry gradients: floating-point and complex tensors."""
    return [t for t in tensors(message) if t.is_floating_point() or t.is_complex()]


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], message: Message) -> Message:
    if isinstance(message, torch.Tensor):
        return fn(message)
    return tuple(fn(t) for t in tensors(message))


def nbytes(message: Message) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(message))


def signature(message: Message) -> tuple:
    """Shapes and dtypes: two messages alike in these cost a layer the same."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors(message))
