"""Parameters tied across stages, as an embedding and the output projection of GPT-2 are.

The model declares tied groups by global name (`LayeredModel.tied`, e.g. ("0.wte.weight",
"13.lm_head.weight")). Each stage that holds a member keeps its own copy; in every pipeline the
holders of a group start from the first member's initial value (a broadcast) and, every step,
sum their gradients (an all-reduce among them, as Megatron does for embeddings), so every copy
takes the same update and the run equals one process with the tie. Gradient clipping counts a
group once (the copies past the first are left out of the norm).

Every rank builds the same process groups in the same order from the plan's layout (c10d
requires it), whether or not it holds a member. Under data_plane.encrypt, holders in different
regions (or any two, with `all`) exchange sealed copies instead (runtime/sealed_exchange.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.sealed_exchange import SealedGather, must_seal, regions_of


@dataclass
class _Held:
    group: object | None         # the holders' process group; None when this stage holds them all
    params: list[nn.Parameter]   # this stage's members
    source: int                  # the rank holding the group's first member
    holders: list[int]           # the group's ranks, ascending
    sealed: SealedGather | None = None  # data_plane.encrypt covers these holders


def _member(name: str) -> tuple[int, str]:
    index, dot, local = name.partition(".")
    if not (dot and index.isdigit() and local):
        raise ValueError(f"tied parameter {name!r} must look like '<layer index>.<parameter name>'")
    return int(index), local


class TiedParameters:
    def __init__(self, groups: tuple[tuple[str, ...], ...], layout: list[pb.StagePlace], rank: int,
                 module: nn.Module, layer_start: int, wire: torch.device, rdzv: pb.Rendezvous | None = None,
                 local_index: Callable[[int], int] | None = None, epoch: str = "") -> None:
        """`epoch`: as GradientSync's (runtime/grad_sync.py), keys of its own after a live move.
        `module`'s layers are the model's from `layer_start` on; or, where a rank runs several
        stages (interleaved 1F1B, ZB-V: its parts' ranges one after another), `local_index` maps a
        model layer to its index in `module`. ZB-V's first and last stage share a node, so an
        embedding tied to the output projection has one holder there: its gradients are summed in
        the process, with no group."""
        local_index = local_index or (lambda index: index - layer_start)
        self.wire = wire
        self._held: list[_Held] = []
        self.duplicates: set[int] = set()  # ids of copies left out of the gradient norm
        mine = next(place for place in layout if place.rank == rank)
        named = dict(module.named_parameters())
        for group in groups:
            members = [_member(name) for name in group]
            for pipeline in sorted({place.pipeline for place in layout}):
                places = [p for p in layout if p.pipeline == pipeline]
                holder_of = [next(p.rank for p in places if p.layer_start <= index < p.layer_end)
                             for index, _ in members]
                holders = sorted(set(holder_of))
                process_group = dist.new_group(holders) if len(holders) > 1 else None
                if pipeline != mine.pipeline or rank not in holders:
                    continue
                params = []
                for position, (index, local) in enumerate(members):
                    if holder_of[position] != rank:
                        continue
                    key = f"{local_index(index)}.{local}"
                    if key not in named:
                        raise ValueError(f"tied parameter {index}.{local} is not a parameter of layer {index}")
                    params.append(named[key])
                    if position > 0:
                        self.duplicates.add(id(named[key]))
                shapes = {tuple(p.shape) for p in params}
                if len(shapes) > 1:
                    raise ValueError(f"tied parameters {group} have different shapes {sorted(shapes)}")
                sealed = None
                if rdzv is not None and must_seal(rdzv.data_plane_encrypt, regions_of(layout, holders)):
                    sealed = SealedGather(rdzv, holders, f"tied {group[0]}{epoch}", process_group)
                self._held.append(_Held(process_group, params, holder_of[0], holders, sealed))

    def share_initial_values(self) -> None:
        """Every copy takes the first member's value (fresh weights; a checkpoint holds equal copies)."""
        with torch.no_grad():
            for held in self._held:
                value = held.params[0].detach().to(self.wire, copy=True)
                if held.sealed is not None:
                    value = held.sealed.gather(value)[held.holders.index(held.source)]
                elif held.group is not None:
                    dist.broadcast(value, src=held.source, group=held.group)
                for p in held.params:
                    p.copy_(value.to(p.device))

    def sum_gradients(self) -> None:
        """Every copy's gradient becomes the sum over all copies (of this pipeline)."""
        for held in self._held:
            total = torch.zeros_like(held.params[0], device=self.wire)
            for p in held.params:
                if p.grad is not None:
                    total += p.grad.to(self.wire)
            if held.sealed is not None:
                total = held.sealed.sum(total)
            elif held.group is not None:
                dist.all_reduce(total, group=held.group)
            for p in held.params:
                p.grad = total.to(p.device, copy=True)
