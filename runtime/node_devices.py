"""The devices a node announces when it joins, found without loading torch where no GPU can be.

An agent only supervises workers: torch is loaded by its workers, never by the agent itself,
except to ask a GPU driver about its devices. Loading torch costs an agent about 2 s of CPU
and 200 MB. On a host with no GPU driver to be seen (no device node or module of NVIDIA, AMD,
WSL2 or Jetson, and no CUDA driver library) `torch.cuda.is_available()` is False whatever torch
build is installed, so the answer is the CPU and torch is not loaded.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import platform

import psutil

from hetlaunch.protos import control_pb2 as pb

# NVIDIA (/dev/nvidia*, its module), AMD ROCm (/dev/kfd), WSL2 (/dev/dxg), Jetson (/dev/nvhost-*).
GPU_DRIVER_PATHS = ("/dev/nvidia*", "/proc/driver/nvidia", "/sys/module/nvidia", "/dev/kfd", "/dev/dxg",
                    "/dev/nvhost-*")


def gpu_driver_present() -> bool:
    """A GPU driver may be here; or the CUDA driver library is installed (a device node made only on
    first use); or HETLAUNCH_PROBE_GPU=1 asks torch whatever the host shows."""
    if os.environ.get("HETLAUNCH_PROBE_GPU") == "1":
        return True
    if any(glob.glob(pattern) if "*" in pattern else os.path.exists(pattern) for pattern in GPU_DRIVER_PATHS):
        return True
    return ctypes.util.find_library("cuda") is not None


def _uuid_of(properties) -> str:
    """The GPU's UUID as the driver gives it (the same whatever CUDA_VISIBLE_DEVICES numbers it),
    or "" where this torch does not report one."""
    return str(getattr(properties, "uuid", "") or "")


def describe_devices() -> list[pb.Device]:
    if gpu_driver_present():
        import torch  # only here: the driver may expose devices that only torch can describe

        if torch.cuda.is_available():
            return [pb.Device(kind=pb.DEVICE_KIND_CUDA, name=torch.cuda.get_device_name(i), index=i,
                              memory_bytes=torch.cuda.get_device_properties(i).total_memory,
                              uuid=_uuid_of(torch.cuda.get_device_properties(i)))
                    for i in range(torch.cuda.device_count())]
    return [pb.Device(kind=pb.DEVICE_KIND_CPU, name=platform.processor() or platform.machine(), index=0,
                      memory_bytes=psutil.virtual_memory().total)]
