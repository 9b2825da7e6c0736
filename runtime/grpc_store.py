"""A c10d store whose keys live on the coordinator (launcher/rendezvous_store.py), reached
through its authenticated (and, with TLS, encrypted) gRPC service — so the data plane's
rendezvous needs no port of its own that anyone could read or write.

A `torch.distributed.Store` subclass: gloo and NCCL rendezvous through it like through a
TCPStore (set, get, add, compare_set, wait, check, delete_key, num_keys).
"""

from __future__ import annotations

import datetime

import grpc
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY
from hetlaunch.runtime.tls import ClientTls


class GrpcStore(dist.Store):
    def __init__(self, access: wpb.StoreAccess, timeout: datetime.timedelta, prefix: str = "") -> None:
        super().__init__()
        self._prefix = prefix  # every key lives under it (a generation's namespace)
        if access.ca_pem:
            credentials = ClientTls(access.ca_pem, access.cert_pem, access.key_pem).credentials()
            self._channel = grpc.secure_channel(access.address, credentials)
        else:
            self._channel = grpc.insecure_channel(access.address)
        self._stub = control_pb2_grpc.CoordinatorStub(self._channel)
        self._metadata = ((TOKEN_METADATA_KEY, access.token),)
        self._agent_id = access.agent_id
        self._timeout_s = timeout.total_seconds()

    def _call(self, request: pb.StoreRequest, wait_s: float | None = None) -> pb.StoreResponse:
        request.timeout_s = self._timeout_s if wait_s is None else wait_s
        request.keys[:] = [self._prefix + key for key in request.keys]
        request.agent_id = self._agent_id
        try:
            return self._stub.StoreOp(request, metadata=self._metadata, timeout=request.timeout_s + 10)
        except grpc.RpcError as err:
            raise RuntimeError(f"rendezvous store on the coordinator: {err.code().name} {err.details()}") from None

    def set(self, key: str, value) -> None:
        self._call(pb.StoreRequest(op="set", keys=[key], value=_bytes(value)))

    def get(self, key: str) -> bytes:
        reply = self._call(pb.StoreRequest(op="get", keys=[key]))
        if not reply.ok:
            raise RuntimeError(f"rendezvous store: key {key!r} did not appear within {self._timeout_s:.0f}s")
        return reply.value

    def add(self, key: str, amount: int) -> int:
        return self._call(pb.StoreRequest(op="add", keys=[key], amount=amount)).number

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call(pb.StoreRequest(op="compare_set", keys=[key], expected=_bytes(expected),
                                          value=_bytes(desired))).value

    def wait(self, keys, timeout: datetime.timedelta | None = None) -> None:
        wait_s = timeout.total_seconds() if timeout is not None else self._timeout_s
        if not self._call(pb.StoreRequest(op="wait", keys=list(keys)), wait_s).ok:
            raise RuntimeError(f"rendezvous store: keys {list(keys)} did not appear within {wait_s:.0f}s")

    def check(self, keys) -> bool:
        return self._call(pb.StoreRequest(op="check", keys=list(keys))).ok

    def delete_key(self, key: str) -> bool:
        return self._call(pb.StoreRequest(op="delete", keys=[key])).ok

    def num_keys(self) -> int:
        return self._call(pb.StoreRequest(op="num_keys")).number

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()


def _bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
