"""Layers' state (parameters, buffers, optimizer state) sent between running stages over the data plane.

A live move (runtime/stage_move.py) changes which rank holds which layers. Every rank knows the
transfers from the old and new layouts alone (runtime/transfer_plan.py) and walks them in that
one global order with blocking sends and receives: the earliest unfinished transfer always has
both ends ready for it, so the walk cannot deadlock.

One layer on the wire: an int64 length, a JSON header (keys, dtypes, shapes) as bytes, then each
tensor's bytes. The receiver parses JSON only, accepts only keys of that layer and dtypes it
knows, and bounds the sizes: what comes from another host never runs code here.
"""

from __future__ import annotations

import json
import math

import torch
import torch.distributed as dist
from torch import Tensor

from hetlaunch.runtime.checkpoint_manifest import layer_of
from hetlaunch.runtime.transfer_plan import Transfer, TransferError

MAX_HEADER_BYTES = 4 * 2**20
MAX_TENSORS_PER_LAYER = 4096
MAX_LAYER_BYTES = 64 * 2**30
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def send_layer(state: dict[str, Tensor], layer: int, dst: int, wire: torch.device) -> int:
    """Send one layer's entries of `state` (global keys, runtime/checkpoint_manifest.py) to rank `dst`; returns bytes sent."""
    items = sorted((k, v) for k, v in state.items() if layer_of(k) == layer)
    header = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in items]).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=wire), dst=dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(wire), dst=dst)
    sent = 0
    for _, tensor in items:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(wire)
        if data.numel():
            dist.send(data, dst=dst)
        sent += data.numel()
    return sent + len(header) + 8


def recv_layer(layer: int, src: int, wire: torch.device) -> tuple[dict[str, Tensor], int]:
    """Receive one layer's state from rank `src` (CPU tensors under global keys) and the bytes received."""
    length = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.recv(length, src=src)
    size = int(length.item())
    if not 0 < size <= MAX_HEADER_BYTES:
        raise TransferError(f"layer {layer} from rank {src}: a header of {size} bytes")
    raw = torch.empty(size, dtype=torch.uint8, device=wire)
    dist.recv(raw, src=src)
    entries = _parse_header(bytes(raw.cpu().numpy()), layer, src)
    state, received = {}, 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        data = torch.empty(nbytes, dtype=torch.uint8, device=wire)
        if nbytes:
            dist.recv(data, src=src)
        state[key] = data.cpu().view(dtype).reshape(shape)
        received += nbytes
    return state, received + size + 8


def _parse_header(raw: bytes, layer: int, src: int) -> list[tuple[str, torch.dtype, list[int]]]:
    where = f"layer {layer} from rank {src}"
    try:
        entries = json.loads(raw)
    except ValueError:
        raise TransferError(f"{where}: the header is not JSON") from None
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS_PER_LAYER:
        raise TransferError(f"{where}: the header is not a list of at most {MAX_TENSORS_PER_LAYER} tensors")
    parsed, total = [], 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and entry[1] in _DTYPES and isinstance(entry[2], list)
                and all(type(n) is int and 0 <= n < 2**40 for n in entry[2]) and len(entry[2]) <= 8):
            raise TransferError(f"{where}: a malformed entry {str(entry):.120}")
        if layer_of(entry[0]) != layer:
            raise TransferError(f"{where}: key {entry[0]!r:.80} is not of layer {layer}")
        dtype = _DTYPES[entry[1]]
        total += math.prod(entry[2]) * torch.empty(0, dtype=dtype).element_size()
        if total > MAX_LAYER_BYTES:
            raise TransferError(f"{where}: more than {MAX_LAYER_BYTES:,} bytes")
        parsed.append((entry[0], dtype, entry[2]))
    return parsed


def exchange(moves: list[Transfer], rank: int, state: dict[str, Tensor],
             wire: torch.device) -> tuple[dict[str, Tensor], int, int]:
    """Walk the transfers: send what this rank gives away from `state`, receive what it gains.
    Returns the received state and the bytes sent and received."""
    received: dict[str, Tensor] = {}
    sent = got = 0
    for move in moves:
        if move.src == rank:
            sent += send_layer(state, move.layer, move.dst, wire)
        elif move.dst == rank:
            layer_state, nbytes = recv_layer(move.layer, move.src, wire)
            received.update(layer_state)
            got += nbytes
    return received, sent, got
