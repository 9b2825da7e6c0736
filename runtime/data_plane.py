"""Joining the data plane: the c10d group of one generation, and where tensors cross it."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.grpc_store import GrpcStore
from hetlaunch.runtime.wire import wire_device_type


_LIVE_STORES: list[GrpcStore] = []


def init_data_plane(rdzv: pb.Rendezvous, access: wpb.StoreAccess) -> None:
    """Join this generation's c10d group, rendezvousing through the coordinator's store."""
    timeout = datetime.timedelta(seconds=rdzv.timeout_s or 120)
    # One key prefix per plan generation, so a re-plan can rendezvous on the same store.
    store = GrpcStore(access, timeout, prefix=f"gen{rdzv.generation}/")
    # c10d keeps only the C++ half of a Python store: the Python object must stay alive as long
    # as the process groups built on it (new_group calls into it later), or c10d calls a pure
    # virtual function. One per generation, and a worker runs few generations.
    _LIVE_STORES.append(store)
    dist.init_process_group(rdzv.backend or "gloo", store=store, rank=rdzv.rank,
                            world_size=rdzv.world_size, timeout=timeout)


def wire_device(device: torch.device, backend: str) -> torch.device:
    """The device this agent's tensors cross the data plane on (runtime/wire.py's rule)."""
    return device if wire_device_type(device.type, backend) == device.type else torch.device("cpu")
