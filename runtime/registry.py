"""The names and numbers launcher and runtime share, one table each, with no torch and no protos.

The planner (launcher/planning) imports this module and nothing else of the runtime, so a
plan can be made where torch is not installed. Everything that spells a codec or schedule
name — the YAML schema, the CLI choices, the proto mapping (runtime/wire.py), the codec
implementations (runtime/codecs.py), the planner's lossiness order — is derived from here,
and tests/stage/test_registry.py ties the implementations to these tables.
"""

from __future__ import annotations

from dataclasses import dataclass

# Micro-batches in one step, at most: the YAML's bound and the planner's (the search grows with the
# count: 10,000 planned in 2.4 s and 100,000 in 32 s on 2 cores; 16 million, a global batch of
# 2**24 at size 1, ran out of memory).
MAX_MICROBATCHES = 16384
QUANT_BLOCK = 64  # values per float32 scale in the blockwise integer codecs (runtime/quantize.py)
SCALE_BYTES = 4


@dataclass(frozen=True)
class CodecInfo:
    """What the planner needs to know of a codec: its size on the wire, and how lossy it is."""

    name: str
    value_bits: int | None  # bits per value on the wire; None: the tensor's own itemsize (no compression)
    scaled: bool = False    # one float32 scale per QUANT_BLOCK values (blockwise integer codecs)

    def wire_bytes(self, numel: int, itemsize: int) -> int:
        """Bytes on the wire for a floating-point tensor of `numel` values of `itemsize` bytes."""
        if self.value_bits is None:
            return numel * itemsize
        if not self.scaled:
            return numel * self.value_bits // 8
        blocks = -(-numel // QUANT_BLOCK)
        return blocks * (QUANT_BLOCK * self.value_bits // 8 + SCALE_BYTES)

    def wire_ratio(self, itemsize: int = 4) -> float:
        """Bytes on the wire per raw byte of a large tensor (float32 unless told)."""
        numel = 1 << 16
        return self.wire_bytes(numel, itemsize) / (numel * itemsize)


# Least lossy first: `auto` walks this order and stops at the first codec that is fast enough.
CODEC_INFOS: tuple[CodecInfo, ...] = (
    CodecInfo("none", None),
    CodecInfo("fp16", 16),
    CodecInfo("bf16", 16),  # fp16's size with less precision
    CodecInfo("int8", 8, scaled=True),
    CodecInfo("int4_rotated", 4, scaled=True),
    CodecInfo("int4", 4, scaled=True),  # int4_rotated's size, more error on heavy-tailed activations
)
CODEC_NAMES: tuple[str, ...] = tuple(c.name for c in CODEC_INFOS)  # also the lossiness order
CODEC_INFOS_BY_NAME: dict[str, CodecInfo] = {c.name: c for c in CODEC_INFOS}

SCHEDULE_NAMES: tuple[str, ...] = ("1f1b", "gpipe", "zb-h1", "zb-h2")
# Schedules where a node runs several stages of its pipeline (runtime/device_schedules.py): the
# planner cuts the model into more stages than nodes and places them as the schedule says.
DEVICE_SCHEDULE_NAMES: tuple[str, ...] = ("interleaved-1f1b", "zb-v")
# `schedule: auto` (the YAML's default): the planner cuts for the first of these, then prices the
# same cut under the others and keeps the fastest whose memory fits (launcher/planning/request.py):
# ZB-H2 only where its 2S - 1 micro-batches in flight fit every stage.
AUTO_SCHEDULE = "auto"
AUTO_SCHEDULES: tuple[str, ...] = ("1f1b", "zb-h1", "zb-h2")
# Each of AUTO_SCHEDULES holds more activations than the one before it (ZB-H2 about twice
# ZB-H1's), so auto moves to a later one only for at least this much more predicted tokens/s:
# less is inside the cost model's error, and not worth the memory a larger micro-batch could use.
AUTO_MORE_MEMORY_GAIN = 1.02
# `schedule: auto` also prices DEVICE_SCHEDULE_NAMES where the job can run them (one pipeline of 2
# nodes or more; launcher/device_schedule_checks.py `auto_refusal`), and takes one only for at least
# this much more predicted tokens/s than the best one-stage-per-node schedule: choosing it switches
# off live moves and restarts on stragglers (they re-cut one stage per node), which a mis-predicted
# gain or a node slowing down mid-run could need, so a gain inside the cost model's error is not worth it.
AUTO_DEVICE_SCHEDULE_GAIN = 1.10
DEFAULT_SCHEDULE = AUTO_SCHEDULE

# How bf16 rounds what crosses a link (runtime/wire_rounding.py); the default is the one that
# ended closest to fp32's loss on bench/precision.py.
LINK_ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
DEFAULT_LINK_ROUNDING = "nearest"

# Gradient sync between pipelines starts a bucket's all-reduce when its last gradient is final;
# the runtime fills buckets up to this size and the planner prices the same cap.
SYNC_BUCKET_BYTES = 4 * 2**20

# What a stage holds per parameter byte whatever the schedule: the parameter, its gradient and
# AdamW's two moments (exp_avg, exp_avg_sq).
ADAMW_STATE_PER_PARAM = 2
STATIC_BYTES_PER_PARAM_BYTE = 2 + ADAMW_STATE_PER_PARAM


def sync_hops(codec: str, holders: int) -> int:
    """Latency hops of one gradient sync among `holders` ranks, one after another: a ring
    all-reduce (codec none) crosses 2(k - 1), the all-gather of a lossy codec k - 1."""
    return 2 * (holders - 1) if codec == "none" else holders - 1


def codec_info(name: str) -> CodecInfo:
    try:
        return CODEC_INFOS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODEC_NAMES)})") from None


# data_plane.encrypt (runtime/sealing.py): here, torch- and cryptography-free, because the planner
# prices what it seals and imports nothing of the runtime but this registry.
def must_seal(mode: str, regions) -> bool:
    """Must what passes among nodes in these regions be sealed under data_plane.encrypt `mode`?
    (`cross_region`: where they span regions; `all`: between any two.)"""
    regions = list(regions)
    if len(regions) < 2:
        return False
    return mode == "all" or (mode == "cross_region" and len(set(regions)) > 1)
