"""This node's devices: what it announces when it joins, and the device a command asks for."""

from __future__ import annotations

import platform

import psutil
import torch

from hetlaunch.protos import control_pb2 as pb


def describe_devices() -> list[pb.Device]:
    if torch.cuda.is_available():
        return [pb.Device(kind=pb.DEVICE_KIND_CUDA, name=torch.cuda.get_device_name(i), index=i,
                          memory_bytes=torch.cuda.get_device_properties(i).total_memory)
                for i in range(torch.cuda.device_count())]
    return [pb.Device(kind=pb.DEVICE_KIND_CPU, name=platform.processor() or platform.machine(), index=0,
                      memory_bytes=psutil.virtual_memory().total)]


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
