"""The contract between launcher and runtime: how names and specs travel in the protos.

The launcher writes commands with these functions and the agent reads them with the same
ones, so a codec, schedule or model is spelled on the wire in exactly one place. Names come
from runtime/registry.py; tests/stage/test_registry.py checks that every proto enum value has a
name here and every name a value.
"""

from __future__ import annotations

from google.protobuf import json_format, struct_pb2

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.registry import CODEC_NAMES, DEVICE_SCHEDULE_NAMES, SCHEDULE_NAMES, sync_hops

CODEC_WIRE_IDS: dict[str, int] = {
    "none": pb.CODEC_NONE, "fp16": pb.CODEC_FP16, "bf16": pb.CODEC_BF16, "int8": pb.CODEC_INT8,
    "int4": pb.CODEC_INT4, "int4_rotated": pb.CODEC_INT4_ROTATED,
}
SCHEDULE_WIRE_IDS: dict[str, int] = {"1f1b": pb.SCHEDULE_1F1B, "gpipe": pb.SCHEDULE_GPIPE, "zb-h1": pb.SCHEDULE_ZB_H1,
                                     "zb-h2": pb.SCHEDULE_ZB_H2, "interleaved-1f1b": pb.SCHEDULE_INTERLEAVED_1F1B,
                                     "zb-v": pb.SCHEDULE_ZB_V}
_CODEC_NAMES_BY_ID = {wire_id: name for name, wire_id in CODEC_WIRE_IDS.items()}
_SCHEDULE_NAMES_BY_ID = {wire_id: name for name, wire_id in SCHEDULE_WIRE_IDS.items()}


def codec_wire_id(name: str) -> int:
    return _lookup(CODEC_WIRE_IDS, name, "unknown codec {!r} (known: " + ", ".join(CODEC_NAMES) + ")")


def codec_name(wire_id: int) -> str:
    return _lookup(_CODEC_NAMES_BY_ID, wire_id, "unknown codec id {} on the wire")


def schedule_wire_id(name: str) -> int:
    return _lookup(SCHEDULE_WIRE_IDS, name, "unknown schedule {!r} (known: " + ", ".join(SCHEDULE_NAMES + DEVICE_SCHEDULE_NAMES) + ")")


def schedule_name(wire_id: int) -> str:
    return _lookup(_SCHEDULE_NAMES_BY_ID, wire_id, "unknown schedule id {} on the wire")


def _lookup(table: dict, key, unknown: str):
    # codec_name runs for every message a link receives: the error text is formatted only on a miss.
    try:
        return table[key]
    except KeyError:
        raise ValueError(unknown.format(key)) from None


def wire_device_type(compute_device_type: str, backend: str) -> str:
    """Where tensors cross the data plane: on the compute device with NCCL (CUDA tensors only),
    on the CPU with gloo."""
    return compute_device_type if backend == "nccl" else "cpu"


def sync_emulation_latency_ms(link_latency_ms: float, codec: str, holders: int) -> float:
    """An emulated sync group's latency: its slowest link's latency once per hop
    (runtime/registry.py sync_hops)."""
    return link_latency_ms * sync_hops(codec, holders)


def model_spec_to_proto(spec: ModelSpec) -> pb.ModelSpec:
    if spec.gpt is not None:
        g = spec.gpt
        return pb.ModelSpec(gpt=pb.GptModel(vocab_size=g.vocab_size, seq_len=g.seq_len, d_model=g.d_model,
                                            n_layers=g.n_layers, n_heads=g.n_heads, d_ff=g.d_ff or 0))
    kwargs = struct_pb2.Struct()
    kwargs.update(spec.kwargs)
    return pb.ModelSpec(entrypoint=pb.EntrypointModel(entrypoint=spec.entrypoint, kwargs=kwargs,
                                                      seq_len=spec.seq_len))


def model_spec_from_proto(model: pb.ModelSpec) -> ModelSpec:
    if model.HasField("gpt"):
        g = model.gpt
        return ModelSpec(gpt=GPTConfig(vocab_size=g.vocab_size, seq_len=g.seq_len, d_model=g.d_model,
                                       n_layers=g.n_layers, n_heads=g.n_heads, d_ff=g.d_ff or None))
    if model.HasField("entrypoint"):
        e = model.entrypoint
        return ModelSpec(entrypoint=e.entrypoint, kwargs=_restore_ints(json_format.MessageToDict(e.kwargs)))
    raise ValueError("the command carries no model")


def _restore_ints(value):
    """A protobuf Struct carries every number as a double: give integral ones back as int (seq_len 16.0 -> 16).

    Entrypoint kwargs are sizes far more often than floats that happen to be whole; a float
    parameter still works when handed an int, a size does not work when handed a float."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _restore_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_ints(v) for v in value]
    return value
