"""Micro-batches decided: the micro-batch size and count for a global batch (`train.global_batch`).

The user fixes the samples per step (G); the planner tries each micro-batch size b that
divides G, from the profile's own size down (MAX_SIZES of them), plans M = G / b
micro-batches for each, and keeps the fastest plan. Smaller micro-batches mean more of them
per step and a smaller pipeline bubble, less activation memory and smaller transfers, but
each does less work per kernel launch: the trade is priced from measurements, not assumed.

Times at a size b come from a per-token model of the sizes measured: a node's layer
seconds at the profile's `micro_batch_size` and at the sizes in `layer_seconds_by_size`
(`hetlaunch up` measures the smallest size it will try as well). Between two measured
sizes a layer's time is interpolated linearly in b; outside them it is scaled in
proportion to the tokens from the nearest measured size. Activation and boundary bytes
are proportional to b (every tensor that crosses or is kept has the batch dimension);
parameters and optimizer time do not change. The model's error is reported: each measured
size is predicted from the others and compared with what was measured (leave one out).
"""

from __future__ import annotations

from dataclasses import dataclass
from hetlaunch.launcher.planning.profile_file import NodeProfile, Profile
from hetlaunch.runtime.registry import MAX_MICROBATCHES

MAX_SIZES = 4  # micro-batch sizes tried: each is a plan of its own


@dataclass(frozen=True)
class BatchChoice:
    micro_batch_size: int
    num_microbatches: int  # per step, over every pipeline
    per_token_error: float | None  # leave-one-out error of the per-token model; None: one size measured
    measured_sizes: tuple[int, ...]
    tried_sizes: tuple[int, ...]


def describe(choice: BatchChoice) -> str:
    """One line on how the micro-batches were chosen, for plan tables and `hetlaunch plan`."""
    tried = ", ".join(str(b) for b in choice.tried_sizes)
    measured = " and ".join(str(b) for b in choice.measured_sizes)
    if choice.per_token_error is None:
        model = f"times of other sizes scaled per token from size {measured}, error not measured"
    else:
        model = f"per-token model error {choice.per_token_error:.1%} between measured sizes {measured}"
    return (f"global batch {choice.micro_batch_size * choice.num_microbatches}: {choice.num_microbatches} "
            f"micro-batches of {choice.micro_batch_size} (sizes tried: {tried}; {model})")


def measured_sizes(profile: Profile) -> list[int]:
    """The micro-batch sizes every node was timed at, smallest first."""
    sizes = {profile.micro_batch_size}
    for node in profile.nodes:
        sizes |= set(node.layer_seconds_by_size or {})
    return sorted(s for s in sizes if all(_timings(n, profile).get(s) for n in profile.nodes))


def candidate_sizes(global_batch: int, profile_size: int) -> list[int]:
    """Divisors of the global batch up to the profile's micro-batch size, largest first, each
    leaving at most MAX_MICROBATCHES micro-batches (more is past what a step may have and what
    the search can plan: a global batch of 2**24 at size 1 ran out of memory)."""
    divisors = [b for b in range(min(global_batch, profile_size), 0, -1)
                if global_batch % b == 0 and global_batch // b <= MAX_MICROBATCHES]
    return divisors[:MAX_SIZES]


def at_size(profile: Profile, size: int) -> Profile:
    """The profile as if measured at micro-batch size `size` (the per-token model above)."""
    if size == profile.micro_batch_size:
        return profile
    scale = size / profile.micro_batch_size
    layers = [layer.model_copy(update={"activation_bytes": round(layer.activation_bytes * scale),
                                       "output_bytes": round(layer.output_bytes * scale)}) for layer in profile.layers]
    nodes = [_at(node, _predict(_timings(node, profile), size)) for node in profile.nodes]
    return profile.model_copy(update={"micro_batch_size": size, "layers": layers, "nodes": nodes})


def per_token_error(profile: Profile) -> float | None:
    """The largest relative error, over nodes and measured sizes, of predicting a node's whole-model
    time at one measured size from the other sizes; None with a single measured size."""
    sizes = measured_sizes(profile)
    if len(sizes) < 2:
        return None
    worst = 0.0
    for node in profile.nodes:
        timings = _timings(node, profile)
        for size in sizes:
            others = {s: t for s, t in timings.items() if s != size and s in sizes}
            predicted, measured = sum(_predict(others, size)), sum(timings[size])
            worst = max(worst, abs(predicted - measured) / measured)
    return worst


def _at(node: NodeProfile, layer_seconds: list[float]) -> NodeProfile:
    """The node at another size: its layers' times predicted, the backward's split scaled with them."""
    update = {"layer_seconds": layer_seconds, "layer_seconds_by_size": None}
    for name in ("input_grad_seconds", "weight_grad_seconds"):
        measured = getattr(node, name)
        if measured is not None:
            update[name] = [t * new / old if old > 0 else t for t, new, old in zip(measured, layer_seconds,
                                                                                   node.layer_seconds)]
    return node.model_copy(update=update)


def _timings(node: NodeProfile, profile: Profile) -> dict[int, list[float]]:
    return {profile.micro_batch_size: node.layer_seconds, **(node.layer_seconds_by_size or {})}


def _predict(timings: dict[int, list[float]], size: int) -> list[float]:
    """Per-layer seconds at `size`: linear between the measured sizes around it, else per token
    from the nearest one."""
    if size in timings:
        return list(timings[size])
    below = max((s for s in timings if s < size), default=None)
    above = min((s for s in timings if s > size), default=None)
    if below is not None and above is not None:
        w = (size - below) / (above - below)
        return [a + w * (b - a) for a, b in zip(timings[below], timings[above])]
    nearest = below if below is not None else above
    return [t * size / nearest for t in timings[nearest]]



