"""Collectives under data_plane.encrypt: ciphertext cannot be summed, so a sum among ranks whose
bytes must be sealed is an all-gather of sealed point-to-point messages, each rank adding the
copies itself in rank order (every member gets the same bits, as with the lossy codecs' path).

Which collectives must be sealed follows the YAML's data_plane.encrypt, from the regions of the
ranks involved (StagePlace.region): `cross_region` seals a group whose ranks span regions, `all`
every group of two or more. A group's messages go over its own c10d group, so they never
interleave with the pipeline links' messages on the default group; each direction between two
members is its own channel (runtime/sealing.py), kept for the generation so sequence numbers run on.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.registry import must_seal
from hetlaunch.runtime.sealing import ENVELOPE_BYTES, TAG_BYTES, Channel, Opener, Sealer, SealingError, peer_secret


def regions_of(layout: Sequence[pb.StagePlace], ranks: Sequence[int]) -> list[str]:
    region = {place.rank: place.region for place in layout}
    return [region.get(rank, "") for rank in ranks]


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> bytes:
    """The tensors' bytes, one after another (on the CPU: the cipher runs there)."""
    return b"".join(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)


def bytes_tensor(data: bytes, device: torch.device) -> torch.Tensor:
    """A uint8 tensor holding `data`, on `device`."""
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def recv_sealed(opener: Opener, peer: int, group: object | None, device: torch.device, max_bytes: int,
                tag: int = 0, length: int | None = None) -> bytes:
    """The next sealed message from `peer`: its envelope, its length checked against `max_bytes`
    before anything is allocated, then the sealed bytes, opened (SealingError if they fail).

    With `length` (the plaintext's, agreed with the sender beforehand: runtime/link.py), the
    envelope and the sealed bytes are received together, one round trip of the link instead of two.
    gloo delivers a shorter message into the posted buffer, so the envelope's length, checked
    before the sealed bytes are read, says how much of it is the message; a longer one is refused."""
    envelope = torch.empty(ENVELOPE_BYTES, dtype=torch.uint8, device=device)
    if length is None:
        dist.recv(envelope, src=peer, group=group, tag=tag)
        envelope_bytes = envelope.cpu().numpy().tobytes()
        sealed = _buffer(opener, opener.expected_length(envelope_bytes, max_bytes), device)
        dist.recv(sealed, src=peer, group=group, tag=tag)
        return opener.open(envelope_bytes, sealed.cpu().numpy().data)
    sealed = torch.empty(length + TAG_BYTES, dtype=torch.uint8, device=device)
    envelope_work, sealed_work = (dist.irecv(t, src=peer, group=group, tag=tag) for t in (envelope, sealed))
    envelope_work.wait()
    envelope_bytes = envelope.cpu().numpy().tobytes()
    try:
        # The place in the stream is checked by open, after the sealed bytes are in: refused here,
        # the receive already posted for them would stay pending under the link's next messages.
        announced = opener.expected_length(envelope_bytes, max_bytes, place=False)
        if announced > sealed.numel():
            raise SealingError(f"refused a message of {announced - TAG_BYTES} bytes on {opener.channel} (the "
                               f"{length} agreed)", opener.channel)
    except SealingError:
        _REFUSED_BUFFERS.append(sealed)  # its receive is still posted: gloo may write into it later
        raise
    sealed_work.wait()
    return opener.open(envelope_bytes, sealed[:announced].cpu().numpy().data)


def _buffer(opener: Opener, size: int, device: torch.device) -> torch.Tensor:
    """Room for an announced message, or SealingError naming the channel where there is none: the
    length is checked against the stream's bound before authentication, and a bound as large as a
    layer's may still be more than this host can give (out of memory was a crash, not a link fault)."""
    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError):
        raise SealingError(f"refused a message of {size - TAG_BYTES} bytes on {opener.channel}: "
                           f"no room for it here", opener.channel) from None


# Buffers of receives posted for messages refused on their envelope. gloo cannot cancel a posted
# receive and writes into its buffer if bytes ever come, so they must never be freed; a refusal
# ends the stage (the job recovers or stops), so this holds a few at most.
_REFUSED_BUFFERS: list[torch.Tensor] = []


class SealedGather:
    """An all-gather among `ranks` by sealed point-to-point messages over `group`."""

    def __init__(self, rdzv: pb.Rendezvous, ranks: Sequence[int], stream: str, group: object | None):
        self.ranks, self.me, self.group, self.stream = list(ranks), rdzv.rank, group, stream
        peers = [r for r in self.ranks if r != self.me]
        generation, what = rdzv.generation, f"{stream} among ranks {list(ranks)}"
        secrets = {p: peer_secret(rdzv, p, what) for p in peers}
        self._sealers = {p: Sealer(secrets[p], Channel(generation, self.me, p, stream)) for p in peers}
        self._openers = {p: Opener(secrets[p], Channel(generation, p, self.me, stream)) for p in peers}
        self.wire_bytes = 0  # sealed bytes this rank sent, all calls

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor (same shape and dtype on all), in `ranks` order; blocks."""
        device, shape, dtype = tensor.device, tuple(tensor.shape), tensor.dtype
        plain = tensor_bytes([tensor])
        sends, keep = self._send_to_peers(plain, device)
        out = []
        for rank in self.ranks:
            if rank == self.me:
                out.append(tensor.detach().clone())
                continue
            out.append(self._receive(rank, len(plain), device).view(dtype).reshape(shape))
        for work in sends:
            work.wait()
        return out

    def broadcast(self, tensor: torch.Tensor, source: int) -> torch.Tensor:
        """`source`'s tensor on every member (same shape and dtype on all), like dist.broadcast but
        returned: the source seals it to each peer, the others only receive; blocks."""
        device, shape, dtype = tensor.device, tuple(tensor.shape), tensor.dtype
        plain = tensor_bytes([tensor])
        if self.me != source:
            return self._receive(source, len(plain), device).view(dtype).reshape(shape)
        sends, keep = self._send_to_peers(plain, device)
        for work in sends:
            work.wait()
        return tensor.detach().clone()

    def _send_to_peers(self, plain: bytes, device: torch.device) -> tuple[list, list[torch.Tensor]]:
        """Seal `plain` to every peer and start the sends: (their works, the tensors they read,
        which must outlive them)."""
        sends, keep = [], []
        for peer, sealer in self._sealers.items():
            envelope, sealed = sealer.seal(plain)
            for data in (envelope, sealed):
                t = bytes_tensor(data, device)
                keep.append(t)
                sends.append(dist.isend(t, dst=peer, group=self.group))
            self.wire_bytes += len(envelope) + len(sealed)
        return sends, keep

    def _receive(self, peer: int, size: int, device: torch.device) -> torch.Tensor:
        plain = recv_sealed(self._openers[peer], peer, self.group, device, size)
        if len(plain) != size:
            channel = self._openers[peer].channel
            raise SealingError(f"refused {len(plain)} bytes on {channel}: expected {size}", channel)
        return bytes_tensor(plain, device)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The members' sum, added in rank order (the same bits on every member)."""
        parts = self.gather(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """In place, like dist.all_reduce: SUM (added in rank order) or MAX."""
        if op == dist.ReduceOp.SUM:
            tensor.copy_(self.sum(tensor))
        elif op == dist.ReduceOp.MAX:
            tensor.copy_(torch.stack(self.gather(tensor)).amax(dim=0))
        else:
            raise ValueError(f"a sealed all-reduce sums or takes the maximum, not {op}")


def sealed_gather_for(rdzv: pb.Rendezvous | None, layout: Sequence[pb.StagePlace], ranks: Sequence[int],
                      stream: str, group: object | None) -> SealedGather | None:
    """A SealedGather among `ranks` over `group` where data_plane.encrypt covers them, else None.
    Every rank reaches the same answer (from the layout alone), so groups made on that answer
    are made in the same order everywhere."""
    if rdzv is None or not must_seal(rdzv.data_plane_encrypt, regions_of(layout, ranks)):
        return None
    return SealedGather(rdzv, ranks, stream, group)
