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
from hetlaunch.runtime.sealing import ENVELOPE_BYTES, Channel, Opener, Sealer, SealingError


def must_seal(mode: str, regions: Sequence[str]) -> bool:
    """Must a collective among ranks in these regions be sealed under data_plane.encrypt `mode`?"""
    if len(regions) < 2:
        return False
    return mode == "all" or (mode == "cross_region" and len(set(regions)) > 1)


def regions_of(layout: Sequence[pb.StagePlace], ranks: Sequence[int]) -> list[str]:
    region = {place.rank: place.region for place in layout}
    return [region.get(rank, "") for rank in ranks]


class SealedGather:
    """An all-gather among `ranks` by sealed point-to-point messages over `group`."""

    def __init__(self, rdzv: pb.Rendezvous, ranks: Sequence[int], stream: str, group: object | None):
        if not rdzv.data_plane_secret:
            raise SealingError(f"{stream} among ranks {list(ranks)} must be sealed but no data-plane secret came "
                               f"with generation {rdzv.generation}")
        self.ranks, self.me, self.group, self.stream = list(ranks), rdzv.rank, group, stream
        peers = [r for r in self.ranks if r != self.me]
        secret, generation = rdzv.data_plane_secret, rdzv.generation
        self._sealers = {p: Sealer(secret, Channel(generation, self.me, p, stream)) for p in peers}
        self._openers = {p: Opener(secret, Channel(generation, p, self.me, stream)) for p in peers}
        self.wire_bytes = 0  # sealed bytes this rank sent, all calls

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every member's tensor (same shape and dtype on all), in `ranks` order; blocks."""
        device, shape, dtype = tensor.device, tuple(tensor.shape), tensor.dtype
        plain = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        sends, keep = [], []
        for peer, sealer in self._sealers.items():
            envelope, sealed = sealer.seal(plain)
            for data in (envelope, sealed):
                t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
                keep.append(t)
                sends.append(dist.isend(t, dst=peer, group=self.group))
            self.wire_bytes += len(envelope) + len(sealed)
        out = []
        for rank in self.ranks:
            if rank == self.me:
                out.append(tensor.detach().clone())
                continue
            out.append(self._receive(rank, len(plain), device).view(dtype).reshape(shape))
        for work in sends:
            work.wait()
        return out

    def _receive(self, peer: int, size: int, device: torch.device) -> torch.Tensor:
        opener = self._openers[peer]
        envelope = torch.empty(ENVELOPE_BYTES, dtype=torch.uint8, device=device)
        dist.recv(envelope, src=peer, group=self.group)
        envelope_bytes = envelope.cpu().numpy().tobytes()
        sealed = torch.empty(opener.expected_length(envelope_bytes, size), dtype=torch.uint8, device=device)
        dist.recv(sealed, src=peer, group=self.group)
        plain = opener.open(envelope_bytes, sealed.cpu().numpy().data)
        if len(plain) != size:
            raise SealingError(f"refused {len(plain)} bytes on {self.stream} from rank {peer}: expected {size}")
        if not size:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return torch.frombuffer(bytearray(plain), dtype=torch.uint8).to(device)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The members' sum, added in rank order (the same bits on every member)."""
        parts = self.gather(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total
