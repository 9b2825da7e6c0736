"""Codecs for what crosses a pipeline link: encode a tensor into payload tensors, decode back.

A codec is keyed by its wire enum value (`hetlaunch.v1.Codec`); the receiver reads
that value from the header tensor, so each direction of a link can use its own codec
and the receiver needs no configuration. Later codecs (fp16, int8, int4) register here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hetlaunch.protos import control_pb2

PayloadSpec = tuple[tuple[int, ...], torch.dtype]


class Codec(ABC):
    wire_id: int
    name: str

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Payload tensors to send, on the tensor's own device."""

    @abstractmethod
    def payload_specs(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[PayloadSpec]:
        """Shapes and dtypes the receiver allocates for the payloads of a tensor."""

    @abstractmethod
    def decode(self, payloads: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor back (exactly, or approximately for lossy codecs)."""

    def wire_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        total = 0
        for payload_shape, payload_dtype in self.payload_specs(shape, dtype):
            numel = 1
            for d in payload_shape:
                numel *= d
            total += numel * payload_dtype.itemsize
        return total


class NoneCodec(Codec):
    """Sends the tensor as it is."""

    wire_id = control_pb2.CODEC_NONE
    name = "none"

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.contiguous()]

    def payload_specs(self, shape, dtype):
        return [(tuple(shape), dtype)]

    def decode(self, payloads, shape, dtype):
        return payloads[0]


CODECS: dict[int, Codec] = {codec.wire_id: codec for codec in (NoneCodec(),)}
CODECS_BY_NAME: dict[str, Codec] = {codec.name: codec for codec in CODECS.values()}


def codec_by_id(wire_id: int) -> Codec:
    try:
        return CODECS[wire_id]
    except KeyError:
        raise ValueError(f"unknown codec id {wire_id} on the wire") from None


def codec_by_name(name: str) -> Codec:
    try:
        return CODECS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(sorted(CODECS_BY_NAME))})") from None
