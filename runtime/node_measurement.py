"""Measure what this node can do for a job: per-layer time and memory, usable memory, links.

Layer timing runs forward+backward of each layer alone at the job's micro-batch shape,
feeding it the previous layer's real output, on this agent's device: warm-up, then the
median of several repeats (synchronising around timings on CUDA). Emulated slowness is
applied exactly as in training, so the profile sees it the way the executor will.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import psutil
import torch
from torch import nn

from hetlaunch.runtime.boundary import Message, differentiable, map_tensors, nbytes, signature
from hetlaunch.runtime.emulation import ComputeEmulation
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.model import build_layer, describe_model, layer_kind
from hetlaunch.runtime.model_spec import ModelSpec
from hetlaunch.runtime.precision import autocast, compute_dtype, from_wire, to_wire


@dataclass
class LayerMeasurement:
    seconds: float            # forward + backward of one micro-batch
    optimizer_seconds: float  # one AdamW step over the layer's parameters
    param_bytes: int
    activation_bytes: int     # tensors autograd keeps for backward, per micro-batch in flight
    output_bytes: int         # what crosses a stage boundary placed after this layer
    # The backward split as zero-bubble schedules run it (runtime/split_backward.py): the input's
    # gradient with the graph's analysis, and the weights'. Their sum exceeds the backward's share
    # of `seconds` by what splitting costs (two autograd passes, a call per weight group).
    input_grad_seconds: float = 0.0
    weight_grad_seconds: float = 0.0


def usable_memory_bytes(device: torch.device, cap_gb: float = 0.0, fraction: float = 0.0) -> int:
    """Free memory on the device (system memory on CPU), lowered to an emulated cap and, on CUDA,
    to the configured share of the GPU's memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if fraction > 0:
            free = min(free, int(fraction * total))
    else:
        free = psutil.virtual_memory().available
    return min(free, int(cap_gb * 2**30)) if cap_gb > 0 else free


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CpuMeter:
    """CPU seconds (every thread of this process) and wall seconds of the timed compute: their
    ratio is how many cores a stage of this node keeps busy while it computes (an emulated slow
    node sleeps part of it; a GPU stage mostly waits on its kernels)."""

    cpu_s: float = 0.0
    wall_s: float = 0.0

    @property
    def cpu_per_wall(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def _timed(fn, device: torch.device, emulation: ComputeEmulation, meter: CpuMeter | None = None) -> float:
    _sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    mark = emulation.start()
    fn()
    emulation.stretch(mark, device)
    _sync(device)
    elapsed = time.perf_counter() - start
    if meter is not None:
        meter.cpu_s += time.process_time() - cpu
        meter.wall_s += elapsed
    return elapsed


def _saved_bytes(layer: nn.Module, inputs: Message) -> tuple[Message, int]:
    """Run forward once, counting the bytes autograd saves for backward (activation memory)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        # Parameters are saved too (e.g. a Linear's weight); they are counted as parameters already.
        if not isinstance(t, nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inputs)
    return out, sum(seen.values())


def profile_layers(spec: ModelSpec, micro_batch_size: int, device: torch.device, seed: int = 0,
                   emulation: ComputeEmulation = ComputeEmulation(), warmup: int = 2,
                   repeats: int = 5, precision: str = "fp32", meter: CpuMeter | None = None) -> list[LayerMeasurement]:
    """Time and size every layer of the model, one layer on the device at a time.

    A layer of the same kind as one already measured, fed an input of the same shape, that gives
    back that shape, costs what that one cost: it is not built (24 identical blocks are built
    once). The last layer is timed together with the loss, as the last stage runs it. Under
    bf16/fp16 each layer runs under autocast and its output is sized in the compute dtype, as
    a stage sends it.
    """
    model = describe_model(spec, seed)
    vocab = model.vocab_size or 256
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (micro_batch_size, spec.seq_len), generator=generator).to(device)
    targets = torch.randint(0, vocab, (micro_batch_size, spec.seq_len), generator=generator).to(device)
    x = tokens
    results: list[LayerMeasurement] = []
    measured: dict[tuple, LayerMeasurement] = {}
    for index in range(model.num_layers):
        is_last = index == model.num_layers - 1
        kind = layer_kind(model, index)
        key = (kind, signature(x))
        if kind is not None and not is_last and key in measured:
            results.append(measured[key])
            continue
        measurement, out = _measure_layer(build_layer(model, index, seed).to(device), x,
                                          model.loss_fn if is_last else None, targets, device, emulation,
                                          warmup, repeats, compute_dtype(precision), meter)
        results.append(measurement)
        if kind is not None and signature(out) == signature(x):
            measured[key] = measurement  # the next layer of this kind may reuse it: its input is alike
        x = out
    return results


def _measure_layer(layer: nn.Module, x: Message, loss_fn, targets: torch.Tensor, device: torch.device,
                   emulation: ComputeEmulation, warmup: int, repeats: int,
                   dtype: torch.dtype | None, meter: CpuMeter | None = None) -> tuple[LayerMeasurement, Message]:
    params = [p for p in layer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-9) if params else None
    inputs = map_tensors(lambda t: t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else t, x)

    held = []

    def forward():
        with autocast(device, dtype):
            out = layer(inputs)
            if loss_fn is not None:
                out = loss_fn(out, targets)
        held.append(out)

    def backward():
        out = held.pop()
        if loss_fn is not None:
            out.backward()
        else:
            outs = [t for t in differentiable(map_tensors(lambda t: to_wire(t, dtype), out)) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])

    for _ in range(warmup):
        forward()
        backward()
    # (how layers are timed is versioned: runtime/version.py MEASUREMENT_METHOD)
    # forward and backward timed as two pieces, as the executor runs them (two actions, each
    # stretched under `emulate: speed`, each starting after a wait): timed as one, the backward
    # started warm from its forward, and a small layer's training compute came out 1.2-1.3x its
    # profile (bench/cost_model_error.py, 2026-12-03)
    seconds = statistics.median(_timed(forward, device, emulation, meter) + _timed(backward, device, emulation, meter)
                                for _ in range(repeats))
    input_grad_s, weight_grad_s = _split_seconds(layer, inputs, loss_fn, targets, device, emulation, dtype,
                                                 params, warmup, repeats)
    opt_seconds = 0.0
    if optimizer is not None:
        optimizer.step()  # the first step allocates state; time the later ones
        opt_seconds = statistics.median(_timed(optimizer.step, device, emulation) for _ in range(repeats))
    with autocast(device, dtype):
        out, activation_bytes = _saved_bytes(layer, inputs)
    out = map_tensors(lambda t: to_wire(t, dtype), out)
    return LayerMeasurement(seconds=seconds, optimizer_seconds=opt_seconds, input_grad_seconds=input_grad_s,
                            weight_grad_seconds=weight_grad_s,
                            param_bytes=sum(p.numel() * p.element_size() for p in params),
                            activation_bytes=activation_bytes,
                            output_bytes=nbytes(out)), map_tensors(lambda t: from_wire(t.detach(), dtype), out)


def _split_seconds(layer: nn.Module, inputs: Message, loss_fn, targets: torch.Tensor, device: torch.device,
                   emulation: ComputeEmulation, dtype: torch.dtype | None, params: list, warmup: int,
                   repeats: int) -> tuple[float, float]:
    """The layer's backward split into I and W (each after an untimed, stretched forward): medians."""
    from hetlaunch.runtime.split_backward import SplitBackward

    def prepared():
        with autocast(device, dtype):
            out = layer(inputs)
            if loss_fn is not None:
                outs, grads = [loss_fn(out, targets)], [None]
        if loss_fn is None:
            outs = [t for t in differentiable(map_tensors(lambda t: to_wire(t, dtype), out)) if t.requires_grad]
            grads = [torch.ones_like(t) for t in outs]
        backward = [None]

        def input_pass():  # the graph's analysis is part of it, as in the executor
            backward[0] = SplitBackward(outs, grads, list(differentiable(inputs)), params)
            backward[0].input_grads()
        return input_pass, lambda: backward[0].weight_grads()

    timings = []
    for i in range(warmup + repeats):
        # the forward runs as a piece of its own, stretched like any (untimed here): I then starts as
        # in training, after the node slept out its forward, not straight after it with warm caches;
        # under `emulate: speed` that start costs I 1.3-1.5x a warm one (tiny GPT blocks on CPU),
        # which a profile that ran I at once priced as a split costing nothing over the backward
        made = []
        _timed(lambda: made.append(prepared()), device, emulation)
        input_pass, weight_pass = made[0]
        if i < warmup:
            input_pass()
            weight_pass()
            continue
        timings.append((_timed(input_pass, device, emulation), _timed(weight_pass, device, emulation)))
    no_input_gradient = not differentiable(inputs)  # token ids: I has nothing to do, W is the whole backward
    return (0.0 if no_input_gradient else statistics.median(t for t, _ in timings),
            statistics.median(t for _, t in timings))


def codec_seconds_per_byte(sample: torch.Tensor, repeats: int = 5) -> dict[str, float]:
    """Encode + decode time of every codec on an activation-sized tensor, per raw byte."""
    from hetlaunch.runtime.codecs import CODECS_BY_NAME

    device = sample.device
    raw = sample.numel() * sample.element_size()
    timings = {}
    for name, codec in CODECS_BY_NAME.items():
        def round_trip():
            codec.decode(codec.encode(sample), tuple(sample.shape), sample.dtype)

        round_trip()  # warm-up
        timings[name] = statistics.median(_timed(round_trip, device, ComputeEmulation()) for _ in range(repeats)) / raw
    return timings


def cipher_seconds_per_byte(num_bytes: int, repeats: int = 5) -> float:
    """AES-256-GCM seal + open of a message of `num_bytes` (a boundary's size), per byte, on this
    node's CPU (the cipher runs there whatever the device); 0.0 where `cryptography` is missing
    (encryption is then refused before a job starts)."""
    try:
        from hetlaunch.runtime.sealing import Channel, Opener, Sealer, SealingError, new_secret
        secret, channel = new_secret(), Channel(0, 0, 1, "probe")
        sealer, opener = Sealer(secret, channel), Opener(secret, channel)
    except (ImportError, SealingError):
        return 0.0
    message = os.urandom(max(num_bytes, 4096))
    opener.open(*sealer.seal(message))  # warm-up

    def round_trip() -> float:
        start = time.perf_counter()
        opener.open(*sealer.seal(message))
        return time.perf_counter() - start
    return statistics.median(round_trip() for _ in range(repeats)) / len(message)


PROBE_SIZES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
# A larger size is probed only while the last one's transfer, grown in proportion, stays under
# this: the three sizes three times each took about 70 s at 2 Mbit/s, and below about 1 Mbit/s
# passed the data plane's 120 s receive timeout, so profiling failed after two silent minutes.
PROBE_SIZE_BUDGET_S = 2.0


def probe_link(link: Link, initiator: bool, pings: int = 8, sizes=PROBE_SIZES,
               repeats: int = 3) -> tuple[float, float] | None:
    """Measure one link with its peer; the initiator returns (latency_s, bandwidth_bytes_per_s).

    Latency is half the median round trip of a tiny ping-pong; bandwidth is the slope of a
    least-squares fit of transfer time = 2 * latency + bytes / bandwidth over a few sizes,
    each the fastest of a few repeats (a 1-element reply marks the transfer done). After each
    size the initiator tells its peer whether the next is worth its time (PROBE_SIZE_BUDGET_S);
    from one size alone, bandwidth is that size over its time less the round trip.
    """
    ping = torch.zeros(1)
    rtts = []
    for _ in range(pings):
        if initiator:
            start = time.perf_counter()
            link.send(ping)
            link.recv()
            rtts.append(time.perf_counter() - start)
        else:
            link.send(link.recv())
    points = []
    for k, size in enumerate(sizes):
        payload = torch.zeros(size // 4)
        best = float("inf")
        for _ in range(repeats):
            if initiator:
                start = time.perf_counter()
                link.send(payload)
                link.recv()
                best = min(best, time.perf_counter() - start)
            else:
                link.recv()
                link.send(ping)
        points.append((size, best))
        if k + 1 == len(sizes):
            break
        if initiator:  # the peer follows the initiator's word: go on (1) or stop (0)
            more = best * sizes[k + 1] / size < PROBE_SIZE_BUDGET_S
            link.send(torch.tensor([1.0 if more else 0.0]))
        else:
            more = link.recv().item() == 1.0
        if not more:
            break
    link.drain()
    if not initiator:
        return None
    latency = statistics.median(rtts) / 2
    if len(points) == 1:
        size, seconds = points[0]
        return latency, size / max(seconds - 2 * latency, 1e-9)
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    return latency, bandwidth

