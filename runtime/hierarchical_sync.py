"""Hierarchical gradient sync: sum inside each region, exchange between regions, broadcast back.

A sync group whose holders span regions (launcher/planning/sync_cost.py chooses this when it
prices faster than one flat ring) sums a bucket in three phases:

1. every region with two or more holders all-reduces the bucket over its fast links;
2. each region's first holder in pipeline order (its leader) exchanges the region's sum with
   the other leaders over the slow links: an all-reduce (codec none), or an all-gather of the
   encoded sums, decoded and added in region order, the codec's loss carried to the next step
   (error feedback, on the leader);
3. each leader broadcasts the total inside its region.

Only one copy per region crosses a slow link, and the slow ring has r - 1 hops for r regions
instead of k - 1 for k holders. Every holder ends with the leaders' bit-identical total.

Phases 2 and 3 wait on phase 1, so a bucket moves on when the stage next looks (each gradient
hook during the backward, then `finish`, which polls until every bucket is done). Collectives on one c10d group must be issued in the
same order by all its members: each phase has its own groups (one per region for phases 1 and 3,
one among leaders for phase 2), and a leader moves its buckets to a phase strictly in launch
order, so every group sees the buckets in backward order on every member. A non-leader posts its
receive of the broadcast at launch, into its own buffer, and never issues anything later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetlaunch.runtime import host_clock
from hetlaunch.runtime.codecs import Codec
from hetlaunch.runtime.emulation import WireEmulation

LAUNCHED, EXCHANGING, BROADCASTING, DONE = 1, 2, 3, 4


@dataclass(frozen=True)
class RegionTiers:
    """This rank's c10d groups for one hierarchical sync group."""

    leaders: object | None  # the leaders' group (leaders only)
    reduce: object | None  # this region's group for phase 1 (None: alone in its region)
    broadcast: object | None  # this region's group for phase 3
    leader_rank: int  # this region's leader (global rank)
    is_leader: bool
    regions: int  # how many regions the group spans


def region_members(ranks: tuple[int, ...], regions: tuple[int, ...]) -> list[list[int]]:
    """The ranks of each region group 0, 1, ..., in pipeline order (the first is the leader)."""
    if len(regions) != len(ranks):
        raise ValueError(f"a hierarchical sync group names {len(regions)} regions for {len(ranks)} ranks")
    count = max(regions) + 1
    members = [[r for r, g in zip(ranks, regions) if g == index] for index in range(count)]
    if any(not m for m in members):
        raise ValueError(f"region groups {list(regions)} must be numbered 0, 1, ... without a gap")
    return members


def make_tiers(ranks: tuple[int, ...], regions: tuple[int, ...]) -> RegionTiers | None:
    """Every rank of the job makes every group, in one order (c10d requires it); None where this
    rank is not a holder."""
    members = region_members(ranks, regions)
    me = dist.get_rank()
    leaders = dist.new_group([m[0] for m in members])
    mine: dict[str, object] = {}
    for group in members:
        if len(group) < 2:
            continue
        reduce, broadcast = dist.new_group(group), dist.new_group(group)
        if me in group:
            mine = {"reduce": reduce, "broadcast": broadcast}
    if me not in ranks:
        return None
    home = next(group for group in members if me in group)
    return RegionTiers(leaders=leaders if me == home[0] else None, reduce=mine.get("reduce"),
                       broadcast=mine.get("broadcast"), leader_rank=home[0], is_leader=me == home[0],
                       regions=len(members))


class HierarchicalBucket:
    """One bucket's three phases on this rank (module docstring)."""

    def __init__(self, tiers: RegionTiers, flat: torch.Tensor, codec: Codec, emulation: WireEmulation | None,
                 error: torch.Tensor | None):
        self.tiers, self.codec, self.emulation = tiers, codec, emulation
        self.flat = flat
        self.error = error  # the leader's carried codec loss (lossy codecs)
        self.state = LAUNCHED
        self.work: list = []
        self.total: torch.Tensor | None = None
        self.wire_bytes = 0  # what this rank sent towards other regions
        self._gathered: list[list[torch.Tensor]] | None = None
        self._started_at: torch.Tensor | None = None
        self._arrival: float | None = None
        if tiers.reduce is not None:
            self.work.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tiers.reduce, async_op=True))
        if not tiers.is_leader:
            self.total = torch.empty_like(flat)
            self.work.append(dist.broadcast(self.total, src=tiers.leader_rank, group=tiers.broadcast, async_op=True))
            self.state = BROADCASTING

    def advance(self, may_reach: int) -> bool:
        """Move on as far as the finished work allows, to `may_reach` at most (the previous
        bucket's state: phases start in launch order). Never waits: a rank blocked on one
        bucket could hold back a launch another rank's bucket waits for. True if it moved."""
        moved = False
        while self.state < DONE and self._ready():
            if self.state == LAUNCHED and may_reach >= EXCHANGING:
                self._exchange()
            elif self.state == EXCHANGING and may_reach >= BROADCASTING:
                self._broadcast()
            elif self.state == BROADCASTING:
                self.work, self.state = [], DONE
            else:
                break
            moved = True
        return moved

    def _ready(self) -> bool:
        if not all(work.is_completed() for work in self.work):
            return False
        for work in self.work:
            work.wait()  # raises what a failed collective raised
        if self.state == EXCHANGING and self.emulation is not None:
            if self._arrival is None:
                self._arrival = self.emulation.arrival(self._started_at.item(), self._slow_bytes())
            if self._arrival > host_clock.now():
                return False
        return True

    def _exchange(self) -> None:
        """Phase 2: the region's sum crosses to the other leaders."""
        group = self.tiers.leaders
        self.work = []
        if self.emulation is not None:
            # The slow transfer starts when the last leader joins: agree on that moment.
            self._started_at = torch.tensor([host_clock.now()], dtype=torch.float64, device=self.flat.device)
            self.work.append(dist.all_reduce(self._started_at, op=dist.ReduceOp.MAX, group=group, async_op=True))
        if self.codec.name == "none":
            self.work.append(dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group, async_op=True))
            self.wire_bytes = self.flat.numel() * self.flat.element_size()
        else:
            carried = self.flat + (self.error if self.error is not None else 0)
            payloads = self.codec.encode(carried)
            self._gathered = [[torch.empty_like(p) for _ in range(self.tiers.regions)] for p in payloads]
            self.work += [dist.all_gather(out, p.contiguous(), group=group, async_op=True)
                          for out, p in zip(self._gathered, payloads)]
            self.error = carried - self.codec.decode(payloads, tuple(carried.shape), carried.dtype)
            self.wire_bytes = sum(p.numel() * p.element_size() for p in payloads)
        self.state = EXCHANGING

    def _broadcast(self) -> None:
        """Phase 3: the leader hands the total to its region."""
        if self._gathered is None:
            self.total = self.flat
        else:
            shape, dtype = tuple(self.flat.shape), self.flat.dtype
            total = self.codec.decode([payload[0] for payload in self._gathered], shape, dtype).clone()
            for region in range(1, self.tiers.regions):
                total += self.codec.decode([payload[region] for payload in self._gathered], shape, dtype)
            self.total = total
        self.work = []
        if self.tiers.broadcast is not None:
            self.work.append(dist.broadcast(self.total, src=self.tiers.leader_rank, group=self.tiers.broadcast,
                                            async_op=True))
        self.state = BROADCASTING

    def _slow_bytes(self) -> int:
        """What a leader pushes through the slow link: 2(r-1)/r of the bytes for a ring all-reduce,
        (r-1) encoded copies for the all-gather."""
        r = self.tiers.regions
        if self._gathered is None:
            return int(2 * (r - 1) / r * self.flat.numel() * self.flat.element_size())
        return (r - 1) * self.wire_bytes
