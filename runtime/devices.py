"""The torch device a command asks for, in a worker (what an agent announces: runtime/node_devices.py)."""

from __future__ import annotations

import platform

import torch


def resolve_device(name: str) -> torch.device:
    if name in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} requested but CUDA is not available on this node")
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.processor() or platform.machine()}"
