"""The devices a node announces when it joins, found without loading torch where no GPU can be.

An agent only supervises workers: torch is loaded by its workers, never by the agent itself,
except to ask a GPU driver about its devices. Loading torch costs an agent about 2 s of CPU
and 200 MB; on a host with no NVIDIA or AMD kernel driver (no /dev/nvidia*, /dev/kfd or
/proc/driver/nvidia) `torch.cuda.is_available()` is False whatever torch build is installed,
so the answer is the CPU and torch is not loaded.
"""

from __future__ import annotations

import glob
import os
import platform

import psutil

from hetlaunch.protos import control_pb2 as pb

GPU_DRIVER_PATHS = ("/dev/nvidia*", "/dev/kfd", "/proc/driver/nvidia")


def gpu_driver_present() -> bool:
    return any(glob.glob(pattern) if "*" in pattern else os.path.exists(pattern) for pattern in GPU_DRIVER_PATHS)


def describe_devices() -> list[pb.Device]:
    if gpu_driver_present():
        import torch  # only here: the driver may expose devices that only torch can describe

        if torch.cuda.is_available():
            return [pb.Device(kind=pb.DEVICE_KIND_CUDA, name=torch.cuda.get_device_name(i), index=i,
                              memory_bytes=torch.cuda.get_device_properties(i).total_memory)
                    for i in range(torch.cuda.device_count())]
    return [pb.Device(kind=pb.DEVICE_KIND_CPU, name=platform.processor() or platform.machine(), index=0,
                      memory_bytes=psutil.virtual_memory().total)]
