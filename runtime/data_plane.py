"""Joining the data plane: the c10d group of one generation, and where tensors cross it."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.wire import wire_device_type


def init_data_plane(rdzv: pb.Rendezvous) -> None:
    timeout = datetime.timedelta(seconds=rdzv.timeout_s or 120)
    store = dist.TCPStore(rdzv.store_host, rdzv.store_port, is_master=False, timeout=timeout)
    # One key prefix per plan generation, so a re-plan can rendezvous on the same store.
    store = dist.PrefixStore(f"gen{rdzv.generation}/", store)
    dist.init_process_group(rdzv.backend or "gloo", store=store, rank=rdzv.rank,
                            world_size=rdzv.world_size, timeout=timeout)


def wire_device(device: torch.device, backend: str) -> torch.device:
    """The device this agent's tensors cross the data plane on (runtime/wire.py's rule)."""
    return device if wire_device_type(device.type, backend) == device.type else torch.device("cpu")
