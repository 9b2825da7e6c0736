"""Which layers a live move sends, from which rank to which: known to every rank (and to the
coordinator, which prices a move) from the old and new layouts alone.

Every layer a rank gains comes from the rank of its own pipeline that held it (each pipeline
holds every layer). Every rank walks the transfers in the one order given here with blocking
sends and receives (runtime/layer_transfer.py): the earliest unfinished transfer always has both
ends ready for it, so the walk cannot deadlock. Kept apart from the sending itself so that the
coordinator plans moves without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetlaunch.protos import control_pb2 as pb


class TransferError(ValueError):
    """A move that cannot be walked: a layout that moves a rank to another pipeline, or a layer
    message (runtime/layer_transfer.py) that is not what the move expected."""


@dataclass(frozen=True)
class Transfer:
    layer: int
    src: int  # rank that held it
    dst: int  # rank that holds it after the move


def holder(layout: list[pb.StagePlace], pipeline: int, layer: int) -> int:
    return next(p.rank for p in layout if p.pipeline == pipeline and p.layer_start <= layer < p.layer_end)


def transfers(old: list[pb.StagePlace], new: list[pb.StagePlace]) -> list[Transfer]:
    """Every layer some rank holds after the move but not before, with the rank of its pipeline
    that sends it; in layer order, then by receiving rank (the order every rank walks)."""
    before = {p.rank: p for p in old}
    if set(before) != {p.rank for p in new} or any(before[p.rank].pipeline != p.pipeline for p in new):
        raise TransferError("a live move keeps every rank in its pipeline")
    moves = []
    for place in new:
        was = before[place.rank]
        for layer in range(place.layer_start, place.layer_end):
            if not was.layer_start <= layer < was.layer_end:
                moves.append(Transfer(layer, holder(old, place.pipeline, layer), place.rank))
    return sorted(moves, key=lambda t: (t.layer, t.dst))
