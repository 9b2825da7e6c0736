"""The toy model of the several-stages-per-device executor tests (tests/stage/test_device_pipeline.py,
test_device_pipelines_sync.py): eight layers, Linear and Tanh alternating, fixed batches, a
mean-square loss, and its single-process training (one executor holding every layer)."""

from __future__ import annotations

import torch
from torch import nn

from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.schedules import schedule_named

CPU = torch.device("cpu")
WIDTH, LAYERS, M, STEPS = 16, 8, 4, 3


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) if i % 2 == 0 else nn.Tanh() for i in range(LAYERS)]


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(3, WIDTH, generator=g), torch.randn(3, WIDTH, generator=g)) for _ in range(M)]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _reference() -> tuple[list[float], dict]:
    """One process, the whole model, the same micro-batches, the loss over M, AdamW."""
    torch.set_num_threads(1)
    layers = _layers()
    executor = StageExecutor(layers, _loss, is_first=True, is_last=True, device=CPU)
    actions = schedule_named("1f1b").stage_actions(0, 1, M)
    losses = [executor.train_step(actions, _batches(step), M).loss for step in range(STEPS)]
    params = {f"{i}.{name}": p.detach().flatten().tolist()
              for i, layer in enumerate(layers) for name, p in layer.named_parameters()}
    return losses, params


def _close(got: list[float], want: list[float], rel: float = 1e-5) -> bool:
    return all(abs(g - w) <= rel * max(abs(w), 1e-8) for g, w in zip(got, want, strict=True))
