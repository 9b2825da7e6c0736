"""One registry per name (runtime/registry.py): everything that spells a codec or a schedule is
derived from it or tied to it here, so adding a codec or schedule in one place and not the other fails."""

from __future__ import annotations

import typing

import pytest
import torch

from hetlaunch.launcher import cli_plan
from hetlaunch.launcher.cluster_config import TrainConfig
from hetlaunch.launcher.planning.compression import LOSSINESS, CompressionConfig, wire_ratio
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime import codecs, device_schedules, grad_sync, quantize, registry, schedules, wire


def literal_values(annotation) -> set[str]:
    return set(typing.get_args(annotation))


def test_every_proto_codec_has_a_name_and_every_name_a_wire_id_and_an_implementation():
    proto_ids = {v for v in pb.Codec.values() if v != pb.CODEC_UNSPECIFIED}
    assert set(wire.CODEC_WIRE_IDS.values()) == proto_ids
    assert set(wire.CODEC_WIRE_IDS) == set(registry.CODEC_NAMES) == set(codecs.CODECS_BY_NAME)
    for name, wire_id in wire.CODEC_WIRE_IDS.items():
        assert pb.Codec.Name(wire_id) == "CODEC_" + name.upper()
        assert wire.codec_name(wire_id) == name and codecs.codec_by_id(wire_id).name == name
    with pytest.raises(ValueError, match="unknown codec id"):
        wire.codec_name(pb.CODEC_UNSPECIFIED)


@pytest.mark.parametrize("name", registry.CODEC_NAMES)
@pytest.mark.parametrize("shape", [(1,), (63,), (64,), (65,), (8, 64, 33), (1 << 16,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_planner_wire_bytes_equal_the_codecs_payloads(name, shape, dtype):
    numel = 1
    for d in shape:
        numel *= d
    implementation = codecs.CODECS_BY_NAME[name].wire_bytes(shape, dtype)
    assert registry.codec_info(name).wire_bytes(numel, dtype.itemsize) == implementation


def test_every_schedule_has_a_wire_id_an_implementation_and_a_yaml_and_cli_value():
    proto_ids = {v for v in pb.Schedule.values() if v != pb.SCHEDULE_UNSPECIFIED}
    assert set(wire.SCHEDULE_WIRE_IDS.values()) == proto_ids
    per_stage, per_device = set(registry.SCHEDULE_NAMES), set(registry.DEVICE_SCHEDULE_NAMES)
    assert per_stage == set(schedules.SCHEDULES) and per_device == set(device_schedules.DEVICE_SCHEDULES)
    names = per_stage | per_device
    assert set(wire.SCHEDULE_WIRE_IDS) == names and not per_stage & per_device
    # `auto` is the YAML's and the CLI's too: the planner's choice among AUTO_SCHEDULES, all of them real
    assert literal_values(TrainConfig.model_fields["schedule"].annotation) == names | {registry.AUTO_SCHEDULE}
    assert {s.value for s in cli_plan.Schedule} == names | {registry.AUTO_SCHEDULE}
    assert TrainConfig().schedule == registry.DEFAULT_SCHEDULE == registry.AUTO_SCHEDULE
    assert set(registry.AUTO_SCHEDULES) <= per_stage and registry.AUTO_SCHEDULE not in names


def test_yaml_codec_choices_and_lossiness_order_come_from_the_registry():
    fields = CompressionConfig.model_fields
    assert literal_values(fields["intra_region"].annotation) == {"auto", *registry.CODEC_NAMES}
    assert literal_values(fields["gradients"].annotation) == {"same", *registry.CODEC_NAMES}
    assert LOSSINESS == registry.CODEC_NAMES
    assert wire_ratio(LOSSINESS[0]) == 1.0 and all(wire_ratio(n) < 1.0 for n in LOSSINESS[1:])


def test_shared_numbers_have_one_source():
    assert grad_sync.BUCKET_BYTES == registry.SYNC_BUCKET_BYTES
    assert quantize.BLOCK == registry.QUANT_BLOCK
    assert registry.sync_hops("none", 3) == 4 and registry.sync_hops("int8", 3) == 2
