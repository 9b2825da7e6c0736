"""Joining the data plane: the c10d group of one generation, and where tensors cross it."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.grpc_store import GrpcStore
from hetlaunch.runtime.store_keys import generation_prefix
from hetlaunch.runtime.wire import wire_device_type


_LIVE_STORES: list[GrpcStore] = []


class DataPlaneRefusal(RuntimeError):
    """This host cannot keep the data plane where the YAML's data_plane says (one line, names the key)."""


def bind_to_network(rdzv: pb.Rendezvous) -> None:
    """Keep gloo and NCCL on data_plane.interface, and check data_plane.port_range against the
    ports they will take. Before the group exists: both read the variables when it is made."""
    if rdzv.interface:
        try:
            socket.if_nametoindex(rdzv.interface)
        except OSError:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise DataPlaneRefusal(f"data_plane.interface: {rdzv.interface!r} is not a network interface of "
                                   f"{socket.gethostname()} (it has: {names})") from None
        os.environ["GLOO_SOCKET_IFNAME"] = rdzv.interface
        os.environ["NCCL_SOCKET_IFNAME"] = rdzv.interface
    if rdzv.port_low:
        low, high = ephemeral_ports()
        if not rdzv.port_low <= low <= high <= rdzv.port_high:
            raise DataPlaneRefusal(
                f"data_plane.port_range: [{rdzv.port_low}, {rdzv.port_high}] but {socket.gethostname()} hands out "
                f"ports {low}-{high} (gloo and NCCL bind ephemeral ports); set sysctl net.ipv4.ip_local_port_range="
                f"\"{rdzv.port_low} {rdzv.port_high}\" on this host, or widen port_range")


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    with open(path) as f:
        low, high = f.read().split()[:2]
    return int(low), int(high)


def init_data_plane(rdzv: pb.Rendezvous, access: wpb.StoreAccess) -> None:
    """Join this generation's c10d group, rendezvousing through the coordinator's store."""
    bind_to_network(rdzv)
    timeout = datetime.timedelta(seconds=rdzv.timeout_s or 120)
    # One key prefix per plan generation, so a re-plan can rendezvous on the same store.
    store = GrpcStore(access, timeout, prefix=generation_prefix(rdzv.generation))
    # c10d keeps only the C++ half of a Python store: the Python object must stay alive as long
    # as the process groups built on it (new_group calls into it later), or c10d calls a pure
    # virtual function. One per generation, and a worker runs few generations.
    _LIVE_STORES.append(store)
    dist.init_process_group(rdzv.backend or "gloo", store=store, rank=rdzv.rank,
                            world_size=rdzv.world_size, timeout=timeout)


def wire_device(device: torch.device, backend: str) -> torch.device:
    """The device this agent's tensors cross the data plane on (runtime/wire.py's rule)."""
    return device if wire_device_type(device.type, backend) == device.type else torch.device("cpu")
