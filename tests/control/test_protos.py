"""The committed gRPC/protobuf stubs are current, importable under hetlaunch.protos, and follow the proto style."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.timeout(120)
def test_committed_stubs_match_generator():
    result = subprocess.run([sys.executable, str(REPO / "protos" / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=100, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_module_imports_under_versioned_package():
    from hetlaunch.protos import control_pb2, control_pb2_grpc

    assert control_pb2.__name__ == "hetlaunch.protos.control_pb2"
    assert control_pb2.DESCRIPTOR.package == "hetlaunch.v1"
    assert control_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name == "hetlaunch.v1.Coordinator"
    assert hasattr(control_pb2_grpc, "CoordinatorStub")


def _all_enums(file_descriptor):
    """Top-level enums and enums nested in messages, at any depth."""
    enums = list(file_descriptor.enum_types_by_name.values())
    pending = list(file_descriptor.message_types_by_name.values())
    while pending:
        message = pending.pop()
        enums.extend(message.enum_types)
        pending.extend(message.nested_types)
    return enums


def test_every_enum_zero_value_is_unspecified():
    from hetlaunch.protos import control_pb2

    enums = _all_enums(control_pb2.DESCRIPTOR)
    assert enums, "control.proto defines no enums?"
    for enum in enums:
        zero = enum.values_by_number.get(0)
        assert zero is not None, f"{enum.full_name} has no zero value"
        assert zero.name.endswith("_UNSPECIFIED"), f"{enum.full_name}: zero value is {zero.name}"
