"""Gradient sync between pipelines: every holder of a layer ends the step with the same gradient.

Several pipelines train one model, each on its share of the step's micro-batches. Every
pipeline's loss is divided by the *global* micro-batch count, so a pipeline's accumulated
gradient is already its samples' share of the global mean, and summing over the holders
of a layer gives exactly the single-process gradient: weighting by samples is built in.

As in DDP, gradients are bucketed (in backward order, a bucket never spans two sync
groups) and a bucket's reduction starts the moment its last gradient is final — during
the stage's last backward of the step — so sync overlaps the rest of that backward;
`finish` waits for all of them before the optimizer steps.

* codec `none`: one all-reduce (SUM) per bucket over the group's c10d group.
* a lossy codec: each holder encodes gradient + carried error, all-gathers the payloads,
  and decodes and sums them in rank order, so every holder gets bit-identical sums; what
  the codec lost of its own gradient is carried into the next step (error feedback).
* sealed (data_plane.encrypt covers the holders, runtime/sealed_exchange.py): ciphertext cannot
  be summed, so the holders all-gather sealed copies (encoded first by a lossy codec) at `finish`
  and add them in rank order; such a group is never hierarchical, and not emulated.
* hierarchical (a group whose holders span regions, when the planner prices it faster): sum
  inside each region, exchange between the regions' leaders (with the codec), broadcast back
  (runtime/hierarchical_sync.py).

Groups are made once per plan generation, by every rank, in the plan's order (c10d
requires every rank of the job to enter `new_group`, members or not).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.codecs import Codec, codec_by_id
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.sealed_exchange import SealedGather, must_seal, regions_of
from hetlaunch.runtime.hierarchical_sync import DONE, HierarchicalBucket, RegionTiers, make_tiers, region_members
from hetlaunch.runtime.registry import SYNC_BUCKET_BYTES
from hetlaunch.runtime.wire import sync_emulation_latency_ms

BUCKET_BYTES = SYNC_BUCKET_BYTES  # small buckets start sooner; the planner prices the same cap


@dataclass(frozen=True)
class SyncGroupPlan:
    layer_start: int  # [layer_start, layer_end), global layer indices
    layer_end: int
    ranks: tuple[int, ...]
    codec: Codec
    emulation: WireEmulation | None = None  # hierarchical: the link between the regions' leaders
    regions: tuple[int, ...] = ()  # hierarchical: each rank's region group (0, 1, ...); (): one flat ring
    sealed: bool = False  # data_plane.encrypt covers these holders: sealed all-gather


@dataclass
class SyncStats:
    """One step's sync: seconds blocked waiting for it, gradient bytes before and after the codec."""

    blocked_s: float = 0.0
    raw_bytes: int = 0
    wire_bytes: int = 0


@dataclass(eq=False)  # buckets are compared by identity (their fields hold tensors)
class _Bucket:
    params: list[nn.Parameter]
    group: object  # a c10d ProcessGroup, or RegionTiers for a hierarchical group
    plan: SyncGroupPlan
    error: torch.Tensor | None = None  # error feedback, lossy codecs only
    pending: int = 0
    work: list = field(default_factory=list)
    flat: torch.Tensor | None = None
    gathered: list[list[torch.Tensor]] | None = None
    started_at: torch.Tensor | None = None  # emulated links only: the last holder's launch time
    tiered: HierarchicalBucket | None = None  # a hierarchical group's step in progress
    sealed: SealedGather | None = None  # data_plane.encrypt: exchanged sealed at finish
    armed: bool = False  # its gradients are final as they land (GradientSync.arm)


def sync_group_plans(dp: pb.DataParallel) -> list[SyncGroupPlan]:
    plans = []
    for group in dp.sync_groups:
        codec = codec_by_id(group.codec)
        regions = tuple(group.region_of)
        # A hierarchical group's emulated link is the one its region leaders cross.
        crossing = len(region_members(tuple(group.ranks), regions)) if regions else len(group.ranks)
        latency_ms = sync_emulation_latency_ms(group.emulate_latency_ms, codec.name, crossing)
        plans.append(SyncGroupPlan(group.layer_start, group.layer_end, tuple(group.ranks), codec,
                                   WireEmulation.from_spec(group.emulate_bandwidth_mbps, latency_ms), regions))
    return plans


def sealed_plans(plans: list[SyncGroupPlan], layout, mode: str) -> list[SyncGroupPlan]:
    """The plans with `sealed` set where data_plane.encrypt covers the holders (never hierarchical then:
    the intra-region phases would be clear under `all`, and one sealed all-gather serves both modes)."""
    out = []
    for plan in plans:
        seal = must_seal(mode, regions_of(layout, plan.ranks))
        out.append(replace(plan, sealed=True, regions=(), emulation=None) if seal else plan)
    return out


def make_groups(plans: list[SyncGroupPlan]) -> list[object | None]:
    """The c10d groups of each sync group (RegionTiers for a hierarchical one), made by every rank
    in the same order; None where not a member."""
    me = dist.get_rank()
    groups = []
    for plan in plans:
        if plan.regions:
            groups.append(make_tiers(plan.ranks, plan.regions))
            continue
        group = dist.new_group(list(plan.ranks))
        groups.append(group if me in plan.ranks else None)
    return groups


def _not_held(index: int) -> int:
    raise KeyError(index)


class GradientSync:
    """Sums this stage's gradients with the other holders of its layers, bucket by bucket."""

    def __init__(self, layers: list[nn.Module], layer_start: int, plans: list[SyncGroupPlan],
                 groups: list[object | None], wire_device: torch.device, rdzv: pb.Rendezvous | None = None,
                 local_index: Callable[[int], int] | None = None, epoch: str = ""):
        """`epoch` names this set of groups among those the generation builds (a live move builds
        them again: `move N`), so that each has keys of its own (runtime/sealing.py: a recording of
        the groups before a move is refused by those after it).

        `layers` are the model's from `layer_start` on; or, where a rank runs several stages
        (interleaved 1F1B, ZB-V: its parts' ranges one after another, not contiguous in the model),
        `local_index` maps a model layer to its index in `layers` (KeyError for one it does not hold).
        A sync group lies inside one stage of each pipeline, so inside one part here."""
        local_index = local_index or (lambda index: index - layer_start if 0 <= index - layer_start < len(layers)
                                      else _not_held(index))
        self.wire_device = wire_device
        self.stats = SyncStats()  # of the step in progress
        self.buckets: list[_Bucket] = []
        self._armed = False
        self._launched: list[_Bucket] = []
        mine = [(plan, group) for plan, group in zip(plans, groups) if group is not None]
        for plan, group in sorted(mine, key=lambda pg: -pg[0].layer_start):  # backward order
            sealed = SealedGather(rdzv, plan.ranks, f"sync {plan.layer_start}-{plan.layer_end - 1}{epoch}", group) \
                if plan.sealed else None
            try:
                held = [layers[local_index(index)] for index in range(plan.layer_end - 1, plan.layer_start - 1, -1)]
            except KeyError as missing:
                raise ValueError(f"sync group [{plan.layer_start}, {plan.layer_end}) is not inside this stage's "
                                 f"layers: it does not hold layer {missing.args[0]}") from None
            bucket: list[nn.Parameter] = []
            size = 0
            for layer in held:  # backward order
                for param in reversed([p for p in layer.parameters() if p.requires_grad]):
                    if bucket and size + param.numel() * param.element_size() > BUCKET_BYTES:
                        self.buckets.append(_Bucket(bucket, group, plan, sealed=sealed))
                        bucket, size = [], 0
                    bucket.append(param)
                    size += param.numel() * param.element_size()
            if bucket:
                self.buckets.append(_Bucket(bucket, group, plan, sealed=sealed))
        # Only hierarchical buckets have phases to move on from the hooks: the others skip it.
        self._tiered = any(isinstance(b.group, RegionTiers) for b in self.buckets)
        for bucket in self.buckets:
            for param in bucket.params:
                param.register_post_accumulate_grad_hook(self._hook(bucket))

    def arm(self, params: set[int] | None = None) -> None:
        """The next backward is the step's last one: its gradients are final as they land. With
        `params` (ids), only for the buckets made of those parameters: a rank running several
        stages arms each stage's buckets before that stage's last weight gradients, so a stage that
        finishes early syncs while the others compute (a sync group lies inside one stage)."""
        if not self._armed:  # the step's first arming
            self._armed = True
            self._launched = []
            self.stats = SyncStats()
            for bucket in self.buckets:
                bucket.pending = len(bucket.params)
                bucket.armed = False
        for bucket in self.buckets:
            if params is None or all(id(p) in params for p in bucket.params):
                bucket.armed = True

    def _hook(self, bucket: _Bucket):
        def ready(_param: nn.Parameter) -> None:
            if not bucket.armed:
                return
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)
            if self._tiered:
                self._advance()
        return ready

    def _advance(self) -> tuple[bool, bool]:
        """Move hierarchical buckets through their phases, in launch order (hierarchical_sync.py);
        (whether any moved, whether all are done)."""
        may_reach, moved, done = DONE, False, True
        for bucket in self._launched:
            if bucket.tiered is None:
                continue
            moved |= bucket.tiered.advance(may_reach)
            may_reach = bucket.tiered.state
            done &= may_reach == DONE
        return moved, done

    def _drain(self) -> None:
        """Poll the hierarchical buckets until all are done (waiting on any single one could
        deadlock against another rank's order, hierarchical_sync.py)."""
        pause = 0.0002
        while True:
            moved, done = self._advance()
            if done:
                return
            pause = 0.0002 if moved else min(2 * pause, 0.002)
            time.sleep(pause)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(self.wire_device)
        bucket.work = []
        codec = bucket.plan.codec
        if bucket.sealed is not None:  # exchanged at finish, in bucket order on every holder
            bucket.flat = flat
            self.stats.raw_bytes += flat.numel() * flat.element_size()
            self._launched.append(bucket)
            return
        if isinstance(bucket.group, RegionTiers):
            bucket.tiered = HierarchicalBucket(bucket.group, flat, codec, bucket.plan.emulation, bucket.error)
            self.stats.raw_bytes += flat.numel() * flat.element_size()
            self._launched.append(bucket)
            return
        if bucket.plan.emulation is not None:
            # The transfer starts when the last holder joins: agree on that moment (MAX of launch times).
            # On the wire device: an NCCL group takes CUDA tensors only.
            bucket.started_at = torch.tensor([host_clock.now()], dtype=torch.float64, device=self.wire_device)
            bucket.work.append(dist.all_reduce(bucket.started_at, op=dist.ReduceOp.MAX, group=bucket.group,
                                               async_op=True))
        if codec.name == "none":
            bucket.flat = flat
            bucket.work.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=bucket.group, async_op=True))
            wire = flat.numel() * flat.element_size()
        else:
            if bucket.error is None:
                bucket.error = torch.zeros_like(flat)
            flat = flat + bucket.error
            payloads = codec.encode(flat)
            k = len(bucket.plan.ranks)
            bucket.gathered = [[torch.empty_like(p) for _ in range(k)] for p in payloads]
            bucket.work += [dist.all_gather(out, p.contiguous(), group=bucket.group, async_op=True)
                            for out, p in zip(bucket.gathered, payloads)]
            mine = codec.decode(payloads, tuple(flat.shape), flat.dtype)
            bucket.error = flat - mine  # what this step's codec lost, sent with the next step
            bucket.flat = flat
            wire = sum(p.numel() * p.element_size() for p in payloads)
        self.stats.raw_bytes += flat.numel() * flat.element_size()
        self.stats.wire_bytes += wire
        self._launched.append(bucket)

    def finish(self) -> SyncStats:
        """Wait for every bucket (launching any the backward never completed), write the sums back
        into the gradients; return this step's sync figures."""
        start = time.perf_counter()
        for bucket in self.buckets:
            if bucket not in self._launched:
                self._launch(bucket)  # e.g. a parameter that got no gradient this step
        if self._tiered:
            self._drain()
        for bucket in self._launched:
            if bucket.sealed is not None:
                self._exchange_sealed(bucket)
            for work in bucket.work:
                work.wait()
            if bucket.tiered is not None:
                total, bucket.error = bucket.tiered.total, bucket.tiered.error
                self.stats.wire_bytes += bucket.tiered.wire_bytes
                bucket.tiered = None
            else:
                total = self._reduced(bucket)
                if bucket.plan.emulation is not None:
                    bucket.plan.emulation.deliver(bucket.started_at.item(), self._wire_bytes_per_holder(bucket))
            offset = 0
            for param in bucket.params:
                n = param.numel()
                piece = total[offset:offset + n].view_as(param).to(param.device)
                if param.grad is None:
                    param.grad = piece.clone()
                else:
                    param.grad.copy_(piece)
                offset += n
        self._armed = False
        for bucket in self.buckets:
            bucket.armed = False
        self.stats.blocked_s = time.perf_counter() - start
        return self.stats

    def _exchange_sealed(self, bucket: _Bucket) -> None:
        """A sealed bucket: every holder's (encoded) gradient, gathered sealed; `_reduced` adds them."""
        codec, sent_before = bucket.plan.codec, bucket.sealed.wire_bytes
        if codec.name == "none":
            bucket.gathered = [bucket.sealed.gather(bucket.flat)]
        else:
            if bucket.error is None:
                bucket.error = torch.zeros_like(bucket.flat)
            flat = bucket.flat + bucket.error
            payloads = codec.encode(flat)
            bucket.gathered = [bucket.sealed.gather(p.contiguous()) for p in payloads]
            bucket.error = flat - codec.decode(payloads, tuple(flat.shape), flat.dtype)
            bucket.flat = flat
        self.stats.wire_bytes += bucket.sealed.wire_bytes - sent_before

    def _reduced(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.gathered is None:
            return bucket.flat
        codec, shape, dtype = bucket.plan.codec, tuple(bucket.flat.shape), bucket.flat.dtype
        k = len(bucket.plan.ranks)
        total = codec.decode([payload[0] for payload in bucket.gathered], shape, dtype).clone()
        for member in range(1, k):
            total += codec.decode([payload[member] for payload in bucket.gathered], shape, dtype)
        return total

    @staticmethod
    def _wire_bytes_per_holder(bucket: _Bucket) -> int:
        """What each holder pushes through its slowest link: 2(k-1)/k of the bytes for a ring
        all-reduce, (k-1) encoded copies for the all-gather."""
        k = len(bucket.plan.ranks)
        if bucket.gathered is None:
            return int(2 * (k - 1) / k * bucket.flat.numel() * bucket.flat.element_size())
        return (k - 1) * sum(p[0].numel() * p[0].element_size() for p in bucket.gathered)
