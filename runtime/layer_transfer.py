"""Layers' state (parameters, buffers, optimizer state) sent between running stages over the data plane.

A live move (runtime/stage_move.py) changes which rank holds which layers. Every rank knows the
transfers from the old and new layouts alone (runtime/transfer_plan.py) and walks them in that
one global order with blocking sends and receives: the earliest unfinished transfer always has
both ends ready for it, so the walk cannot deadlock.

One layer on the wire: an int64 length, a JSON header (keys, dtypes, shapes) as bytes, then each
tensor's bytes. The receiver parses JSON only, accepts only keys of that layer and dtypes it
knows, and bounds the sizes: what comes from another host never runs code here.

Where data_plane.encrypt covers the two ranks, the same bytes (length, header, tensors) travel as
one sealed message on the pair's "layers" channel (runtime/sealing.py), opened before anything
of it is parsed.
"""

from __future__ import annotations

import json
import math
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint import OPTIMIZER_FIELDS
from hetlaunch.runtime.checkpoint_manifest import layer_of
from hetlaunch.runtime.sealed_exchange import bytes_tensor, must_seal, recv_sealed, tensor_bytes
from hetlaunch.runtime.sealing import ENVELOPE_BYTES, TAG_BYTES, Channel, Opener, Sealer, peer_secret
from hetlaunch.runtime.transfer_plan import Transfer, TransferError

MAX_HEADER_BYTES = 4 * 2**20
MAX_TENSORS_PER_LAYER = 4096
MAX_LAYER_BYTES = 64 * 2**30
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class SealedTransfers:
    """The sealed channels of this rank's layer transfers in one generation, made on first use and
    kept, so each channel's sequence runs on from one move to the next."""

    def __init__(self, rdzv: pb.Rendezvous, layout: Sequence[pb.StagePlace]):
        self.rdzv = rdzv
        self.region = {place.rank: place.region for place in layout}
        self._sealers: dict[int, Sealer] = {}
        self._openers: dict[int, Opener] = {}

    def covers(self, a: int, b: int) -> bool:
        return must_seal(self.rdzv.data_plane_encrypt, [self.region.get(a, ""), self.region.get(b, "")])

    def sealer(self, dst: int) -> Sealer:
        if dst not in self._sealers:
            self._sealers[dst] = Sealer(peer_secret(self.rdzv, dst, f"layers moving to rank {dst}"),
                                        Channel(self.rdzv.generation, self.rdzv.rank, dst, "layers"))
        return self._sealers[dst]

    def opener(self, src: int) -> Opener:
        if src not in self._openers:
            self._openers[src] = Opener(peer_secret(self.rdzv, src, f"layers moving from rank {src}"),
                                        Channel(self.rdzv.generation, src, self.rdzv.rank, "layers"))
        return self._openers[src]


def send_layer(state: dict[str, Tensor], layer: int, dst: int, wire: torch.device,
               sealer: Sealer | None = None) -> int:
    """Send one layer's entries of `state` (global keys, runtime/checkpoint_manifest.py) to rank `dst`
    (sealed with `sealer` if given); returns bytes sent."""
    items = sorted((k, v) for k, v in state.items() if layer_of(k) == layer)
    header = json.dumps([[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in items]).encode()
    if sealer is not None:
        tensors = [torch.tensor([len(header)], dtype=torch.int64), torch.frombuffer(bytearray(header), dtype=torch.uint8)]
        envelope, sealed = sealer.seal(tensor_bytes(tensors + [v for _, v in items]))
        for data in (envelope, sealed):
            dist.send(bytes_tensor(data, wire), dst=dst)
        return len(envelope) + len(sealed)
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=wire), dst=dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(wire), dst=dst)
    sent = 0
    for _, tensor in items:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(wire)
        if data.numel():
            dist.send(data, dst=dst)
        sent += data.numel()
    return sent + len(header) + 8


def most_state_bytes(layer: nn.Module) -> int:
    """The most a layer's state may take (runtime/checkpoint.py stage_state): every parameter and
    buffer, and each optimizer field of it, at its element size or 4 bytes, whichever is more,
    and a MiB for the rest. The receiver of a move bounds what a sender announces by it: a forged
    envelope at the right place in the stream once had it allocate up to MAX_LAYER_BYTES."""
    elements = sum(t.numel() * max(t.element_size(), 4) for t in layer.state_dict().values())
    return min(elements * (1 + len(OPTIMIZER_FIELDS)) + 2**20, MAX_LAYER_BYTES)


def recv_layer(layer: int, src: int, wire: torch.device, opener: Opener | None = None,
               max_bytes: int = MAX_LAYER_BYTES) -> tuple[dict[str, Tensor], int]:
    """Receive one layer's state from rank `src` (CPU tensors under global keys) and the bytes received
    (a sealed message opened with `opener`, if given); more than `max_bytes` of tensors is refused
    before anything is allocated for them."""
    if opener is not None:
        return _recv_sealed_layer(layer, src, wire, opener, max_bytes)
    length = torch.zeros(1, dtype=torch.int64, device=wire)
    dist.recv(length, src=src)
    size = int(length.item())
    if not 0 < size <= MAX_HEADER_BYTES:
        raise TransferError(f"layer {layer} from rank {src}: a header of {size} bytes")
    raw = torch.empty(size, dtype=torch.uint8, device=wire)
    dist.recv(raw, src=src)
    entries = _parse_header(bytes(raw.cpu().numpy()), layer, src, max_bytes)
    state, received = {}, 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        data = torch.empty(nbytes, dtype=torch.uint8, device=wire)
        if nbytes:
            dist.recv(data, src=src)
        state[key] = data.cpu().view(dtype).reshape(shape)
        received += nbytes
    return state, received + size + 8


def _recv_sealed_layer(layer: int, src: int, wire: torch.device, opener: Opener,
                       max_bytes: int) -> tuple[dict[str, Tensor], int]:
    plain = recv_sealed(opener, src, None, wire, 8 + MAX_HEADER_BYTES + max_bytes)
    where = f"layer {layer} from rank {src}"
    size = int.from_bytes(plain[:8], "little", signed=True) if len(plain) >= 8 else -1
    if not 0 < size <= min(MAX_HEADER_BYTES, len(plain) - 8):
        raise TransferError(f"{where}: a header of {size} bytes")
    entries = _parse_header(plain[8:8 + size], layer, src, max_bytes)
    state, offset = {}, 8 + size
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if offset + nbytes > len(plain):
            raise TransferError(f"{where}: shorter than its header says")
        state[key] = torch.frombuffer(bytearray(plain[offset:offset + nbytes]), dtype=torch.uint8).view(dtype).reshape(shape) \
            if nbytes else torch.empty(shape, dtype=dtype)
        offset += nbytes
    if offset != len(plain):
        raise TransferError(f"{where}: longer than its header says")
    return state, len(plain) + ENVELOPE_BYTES + TAG_BYTES


def _parse_header(raw: bytes, layer: int, src: int,
                  max_bytes: int = MAX_LAYER_BYTES) -> list[tuple[str, torch.dtype, list[int]]]:
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
        if total > max_bytes:
            raise TransferError(f"{where}: more than {max_bytes:,} bytes")
        parsed.append((entry[0], dtype, entry[2]))
    return parsed


def exchange(moves: list[Transfer], rank: int, state: dict[str, Tensor], wire: torch.device,
             sealed: SealedTransfers | None = None,
             layer_bytes: Mapping[int, int] | None = None) -> tuple[dict[str, Tensor], int, int]:
    """Walk the transfers: send what this rank gives away from `state`, receive what it gains
    (sealed between ranks `sealed` covers; each layer at most its `layer_bytes`, most_state_bytes).
    Returns the received state and the bytes sent and received."""
    layer_bytes = layer_bytes or {}
    received: dict[str, Tensor] = {}
    sent = got = 0
    for move in moves:
        seal = sealed is not None and sealed.covers(move.src, move.dst)
        if move.src == rank:
            sent += send_layer(state, move.layer, move.dst, wire, sealed.sealer(move.dst) if seal else None)
        elif move.dst == rank:
            layer_state, nbytes = recv_layer(move.layer, move.src, wire, sealed.opener(move.src) if seal else None,
                                             layer_bytes.get(move.layer, MAX_LAYER_BYTES))
            received.update(layer_state)
            got += nbytes
    return received, sent, got
