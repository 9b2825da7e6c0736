"""Outer steps across islands (DiLoCo): islands train apart and meet every H inner steps.

An island is one or more pipelines that sync gradients every step (runtime/grad_sync.py).
Between islands nothing is exchanged for H steps; then, per parameter, each holder's change
since the last outer step (anchor - local, the "pseudo-gradient") is averaged over every
holder of that parameter in every island, weighted by the micro-batches its pipeline trains
per step (an island's weight is its share of the tokens), and an outer optimizer steps the
anchor: Nesterov SGD as in DiLoCo (buf = m * buf + g; anchor -= lr * (g + m * buf)). Every
holder then continues from the new anchor (mixed with its own parameters by `alpha` when the
exchange overlapped `delay` inner steps). Inner optimizer state stays each island's own.

Streaming (Streaming DiLoCo, torchft's `fragment_sync_delay`): the model's layers form
`fragments` contiguous fragments; fragment f meets after steps (f + 1) * H / F, then every H,
so the exchanges are spread over the H steps rather than one whole-model exchange. With
`delay` d > 0 a fragment's exchange is launched after step t and applied after step t + d, so
the collective runs while the next d steps compute; its local parameters then take
alpha * local + (1 - alpha) * new anchor. Training ends with an outer step of every fragment
that did not just have one, applied whole (`final`): the run's model is the anchor.

Wire, hierarchical: replicas of one island are identical, so one delta per island crosses
between islands. Per layer range, the holder in each island's first pipeline (its
representative) all-gathers its encoded delta with the other islands' representatives, each
parameter on its own; they decode and sum in island order and broadcast the average to their
island's other holders (in-island links; sealed, one copy per holder, where data_plane.encrypt
covers them), so every holder computes bit-identical anchors. A lossy
codec carries what it lost into the next exchange (error feedback, the representative's). Encoding per parameter keeps the two copies of a tied parameter identical (their
holders encode the same tensor). Groups are made once per generation by every rank, in order.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hetlaunch.runtime import host_clock
from hetlaunch.runtime.codecs import Codec
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.sealed_exchange import SealedGather
from hetlaunch.runtime.sealing import ENVELOPE_BYTES, TAG_BYTES
from hetlaunch.runtime.serial_worker import SerialWorker


@dataclass(frozen=True)
class OuterSettings:
    every: int             # H: inner steps between two outer steps of a fragment
    lr: float = 0.7        # DiLoCo's outer Nesterov defaults
    momentum: float = 0.9
    fragments: int = 1     # streaming: contiguous layer fragments, exchanged in turn
    delay: int = 0         # inner steps an exchange overlaps before it is applied
    alpha: float = 0.0     # with a delay: the weight of the local parameters when applying

    def __post_init__(self):
        if self.every < 1 or self.fragments < 1 or self.delay < 0 or self.delay >= self.every:
            raise ValueError(f"outer step every {self.every}, {self.fragments} fragments, delay {self.delay}: "
                             f"need every >= 1, fragments >= 1, 0 <= delay < every")


def fragment_of(layer: int, num_layers: int, fragments: int) -> int:
    """The fragment of a global layer index: contiguous, as even as the layer count allows."""
    return layer * fragments // num_layers


def fragment_due(done: int, settings: OuterSettings, fragment: int) -> bool:
    """Whether `fragment` launches its exchange after `done` inner steps (counting from step 0)."""
    first = (fragment + 1) * settings.every // settings.fragments
    return done >= first and (done - first) % settings.every == 0


@dataclass(frozen=True)
class OuterGroupPlan:
    """One layer range's outer exchange. Its holders (one per pipeline) are grouped by island; the
    first holder of each island (its representative) exchanges the island's delta with the other
    islands' representatives, then passes the average on to its island's other holders: what
    crosses between islands is one delta per island, not one per pipeline."""

    layer_start: int                 # [layer_start, layer_end): layers with one holder set
    layer_end: int
    representatives: tuple[int, ...]  # one rank per island, in island order
    weights: tuple[float, ...]       # each island's share of the step's micro-batches (sums to 1)
    island_ranks: tuple[int, ...]    # this rank's island's holders of these layers (its representative first)
    codec: Codec
    emulation: WireEmulation | None = None


@dataclass(eq=False)
class _Held:
    param: nn.Parameter
    layer: int                       # global layer index that sets its fragment (a tied group's first)
    plan: OuterGroupPlan
    exchange: object | None          # c10d group of the representatives, where this rank is one
    island: object | None            # c10d group of the island's holders, where it has several
    anchor: torch.Tensor             # fp32, on the wire device
    momentum: torch.Tensor
    error: torch.Tensor | None = None
    sealed: SealedGather | None = None  # data_plane.encrypt covers the representatives
    shared_sealed: SealedGather | None = None  # ... covers the island's holders: the average passed on sealed

    @property
    def representative(self) -> bool:
        return self.exchange is not None


@dataclass(eq=False)
class _Pending:
    fragment: int
    launched_after: int              # inner steps done when it was launched
    apply_after: int                 # inner steps done when it is applied
    held: list[_Held]
    gathered: list[list[list[torch.Tensor]] | Future | None]  # per held: per payload: per island (representatives
    work: list                                                 # only); sealed, a future of that
    started_at: float
    wire_bytes: dict[int, int] = field(default_factory=dict)  # id(plan) -> bytes this representative sent


@dataclass
class OuterStats:
    """One step's outer exchanges: fragments launched and applied, seconds blocked, bytes."""

    launched: int = 0
    applied: int = 0
    blocked_s: float = 0.0
    raw_bytes: int = 0               # deltas before the codec (representatives only: they send)
    wire_bytes: int = 0              # what this representative sent to the other islands


class OuterSync:
    """The outer steps of one stage's parameters."""

    def __init__(self, layers: list[nn.Module], layer_start: int, num_layers: int, settings: OuterSettings,
                 plans: list[OuterGroupPlan],
                 groups: list[tuple[object | None, object | None, SealedGather | None, SealedGather | None] | None],
                 wire_device: torch.device, state_lock=None, tied: tuple[tuple[str, ...], ...] = ()):
        """`groups[i]`: for plans[i], (representatives' group or None, island holders' group or
        None, the representatives' sealed gather where data_plane.encrypt covers them, the island
        holders' sealed gather where it covers them), or None where this rank holds none of its
        layers."""
        self._sealer: SerialWorker | None = None  # sealed exchanges run here, overlapping the steps
        self.settings, self.num_layers, self.wire = settings, num_layers, wire_device
        # Parameters change under the executor's state lock: a snapshot from another thread sees
        # the state before or after an outer step, never half of one. Held only while applying.
        self.state_lock = state_lock or contextlib.nullcontext()
        self._pending: list[_Pending] = []
        self.held: list[_Held] = []
        # A tied parameter's copies take the fragment of its first member: copies in two fragments
        # would meet at different steps and stop being one weight.
        first_layer = {name: int(group[0].partition(".")[0]) for group in tied for name in group}
        for plan, pair in zip(plans, groups):
            if pair is None:
                continue
            for layer in range(plan.layer_start, plan.layer_end):
                for name, param in layers[layer - layer_start].named_parameters():
                    if param.requires_grad:
                        exchange, island, sealed, shared_sealed = pair
                        anchor = param.detach().to(wire_device, torch.float32, copy=True)
                        self.held.append(_Held(param, first_layer.get(f"{layer}.{name}", layer), plan, exchange,
                                               island, anchor, torch.zeros_like(anchor), sealed=sealed,
                                               shared_sealed=shared_sealed))

    def reset_anchor(self) -> None:
        """The anchor is the parameters as they are now (after tied copies share their value, or a restore)."""
        for held in self.held:
            held.anchor.copy_(held.param.detach().to(self.wire, torch.float32))

    def state_of(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of a parameter's outer state: its anchor and outer momentum."""
        for held in self.held:
            if held.param is param:
                return {"anchor": held.anchor, "momentum": held.momentum}
        return {}

    def load(self, module: nn.Module, state: dict[str, torch.Tensor], layer_start: int) -> None:
        """Anchors and momenta from a checkpoint (`outer.<global layer>.<name>.<field>` keys); a
        parameter the checkpoint has none for (it was written without islands) starts its anchor
        from its weights and its momentum at zero."""
        named = dict(module.named_parameters())
        by_param = {id(h.param): h for h in self.held}
        for key, tensor in state.items():
            _, layer, rest = key.split(".", 2)
            name, _, field = rest.rpartition(".")
            param = named.get(f"{int(layer) - layer_start}.{name}")
            held = by_param.get(id(param)) if param is not None else None
            if held is None or field not in ("anchor", "momentum") or tensor.shape != held.anchor.shape:
                raise ValueError(f"checkpoint key {key!r} is no outer state of this stage's parameters")
            (held.anchor if field == "anchor" else held.momentum).copy_(tensor.to(self.wire, torch.float32))

    def after_step(self, done: int) -> OuterStats:
        """Launch the exchanges due after `done` inner steps and apply those whose delay is over."""
        stats = OuterStats()
        for fragment in range(self.settings.fragments):
            if fragment_due(done, self.settings, fragment):
                held = [h for h in self.held if fragment_of(h.layer, self.num_layers, self.settings.fragments) == fragment]
                self._pending.append(self._launch(fragment, done, held, stats))
                stats.launched += 1
        due = [p for p in self._pending if p.apply_after <= done]
        self._pending = [p for p in self._pending if p.apply_after > done]
        for pending in due:
            start = time.perf_counter()
            self._apply(pending)
            stats.blocked_s += time.perf_counter() - start
            stats.applied += 1
        return stats

    def _launch(self, fragment: int, done: int, held: list[_Held], stats: OuterStats) -> _Pending:
        """Representatives encode their island's delta (with the error carried) and start the all-gather."""
        pending = _Pending(fragment, done, done + self.settings.delay, held, [], [], host_clock.now())
        for h in held:
            if not h.representative:  # its island's representative speaks for it
                pending.gathered.append(None)
                continue
            delta = h.anchor - h.param.detach().to(self.wire, torch.float32)
            codec = h.plan.codec
            if codec.name != "none":
                if h.error is None:
                    h.error = torch.zeros_like(delta)
                delta = delta + h.error
            payloads = [p.contiguous() for p in codec.encode(delta)]
            if codec.name != "none":
                h.error = delta - codec.decode(payloads, tuple(delta.shape), delta.dtype)
            k = len(h.plan.representatives)
            if h.sealed is not None:  # ciphertext cannot be gathered by c10d's all-gather in place
                if self._sealer is None:
                    self._sealer = SerialWorker("outer-sealed-exchange")
                pending.gathered.append(self._sealer.submit(_gather_sealed, h.sealed, payloads))
            else:
                gathered = [[torch.empty_like(p) for _ in range(k)] for p in payloads]
                pending.work += [dist.all_gather(out, p, group=h.exchange, async_op=True)
                                 for out, p in zip(gathered, payloads)]
                pending.gathered.append(gathered)
            sent = sum(p.numel() * p.element_size() for p in payloads)
            if h.sealed is not None:  # each payload to each peer carries an envelope and a tag
                sent += len(payloads) * (ENVELOPE_BYTES + TAG_BYTES)
            pending.wire_bytes[id(h.plan)] = pending.wire_bytes.get(id(h.plan), 0) + (k - 1) * sent
            stats.raw_bytes += delta.numel() * delta.element_size()
            stats.wire_bytes += (k - 1) * sent
        return pending

    def _apply(self, pending: _Pending, alpha: float | None = None, parameters: bool = True) -> None:
        """Representatives average the islands' deltas (decoded and summed in island order) and pass the
        average to their islands' other holders; every holder then steps its anchor the same way
        (and, with `parameters`, takes it into its parameters as `alpha` says)."""
        for work in pending.work:
            work.wait()
        for gathered in pending.gathered:  # sealed exchanges too, before their time on the emulated wire
            if isinstance(gathered, Future):
                gathered.exception()
        emulated = {id(h.plan): h.plan.emulation for h in pending.held
                    if h.representative and h.plan.emulation is not None}
        for key, emulation in emulated.items():  # the bytes' time on the slowest link between islands
            emulation.deliver(pending.started_at, pending.wire_bytes.get(key, 0))
        averages, shares = [], []
        for h, gathered in zip(pending.held, pending.gathered):
            if isinstance(gathered, Future):
                gathered = gathered.result()  # a SealingError from the exchange is raised here
            average = torch.zeros_like(h.anchor)
            if gathered is not None:
                shape, codec = tuple(h.anchor.shape), h.plan.codec
                for member, weight in enumerate(h.plan.weights):
                    average += weight * codec.decode([payload[member] for payload in gathered], shape, torch.float32)
            if h.shared_sealed is not None:  # sealed in-island: the representative seals it to each holder
                average = h.shared_sealed.broadcast(average, h.plan.island_ranks[0])
            elif h.island is not None:  # in-island: the representative's average reaches the other holders
                shares.append(dist.broadcast(average, src=h.plan.island_ranks[0], group=h.island, async_op=True))
            averages.append(average)
        for work in shares:
            work.wait()
        m, lr = self.settings.momentum, self.settings.lr
        alpha = self.settings.alpha if alpha is None else alpha
        with torch.no_grad(), self.state_lock:
            for h, average in zip(pending.held, averages):
                h.momentum.mul_(m).add_(average)
                h.anchor.sub_(lr * (average + m * h.momentum))
                if not parameters:
                    continue
                new = h.anchor if alpha == 0 else alpha * h.param.detach().to(self.wire, torch.float32) + (1 - alpha) * h.anchor
                h.param.copy_(new.to(h.param.device, h.param.dtype))

    def final(self, done: int, stats: OuterStats) -> None:
        """The end of training (after `after_step(done)`): every fragment that did not just launch
        meets once more, and every exchange is applied taking the new anchor whole (no mixing), so
        the run ends on the anchor, every island's steps since its last outer step counted.

        An exchange still waiting out its delay is applied first, to the anchor and momentum only,
        so that its fragment's last exchange, launched after it, carries the islands' change since
        the anchor it made: launched before it (as until 2026-12-06), the last exchange counted the
        change up to the waiting one's launch a second time, and a run ending inside a delay
        window ended 3x the outer step past its anchor (held-out loss 6.5 where 4.5 was right)."""
        just_launched = {p.fragment for p in self._pending if p.launched_after == done}
        start = time.perf_counter()
        for pending in [p for p in self._pending if p.launched_after != done]:
            self._apply(pending, parameters=False)
            stats.applied += 1
            self._pending.remove(pending)
        stats.blocked_s += time.perf_counter() - start
        for fragment in range(self.settings.fragments):
            if fragment not in just_launched and not (self.settings.delay == 0 and fragment_due(done, self.settings,
                                                                                                fragment)):
                held = [h for h in self.held if fragment_of(h.layer, self.num_layers, self.settings.fragments) == fragment]
                self._pending.append(self._launch(fragment, done, held, stats))
                stats.launched += 1
        start = time.perf_counter()
        for pending in self._pending:
            self._apply(pending, alpha=0.0)
            stats.applied += 1
        stats.blocked_s += time.perf_counter() - start
        self._pending = []


def _gather_sealed(sealed: SealedGather, payloads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per payload, every representative's copy in island order (on the serial worker's thread)."""
    return [sealed.gather(p) for p in payloads]
