"""Codecs for what crosses a pipeline link: encode a tensor into payload tensors, decode back.

A codec is keyed by its wire enum value (`hetlaunch.v1.Codec`); the receiver reads
that value from the header tensor, so each direction of a link can use its own codec
and the receiver needs no configuration.

| name           | payloads (n values, nb = ceil(n / 64) blocks)      | wire bytes          |
|----------------|-----------------------------------------------------|---------------------|
| `none`         | the tensor                                          | n * itemsize        |
| `fp16`, `bf16` | the tensor cast to float16 / bfloat16               | 2 n                 |
| `int8`         | int8 (nb, 64), float32 scales (nb,)                 | 64 nb + 4 nb        |
| `int4`         | uint8 (nb, 32), two nibbles a byte; scales (nb,)    | 32 nb + 4 nb        |
|                | (byte i: value i + 8 low, value i + 32 + 8 high)    |                     |
| `int4_rotated` | as int4, after the seeded block Hadamard rotation   | 32 nb + 4 nb        |

The lossy codecs act on floating-point tensors only; a tensor of any other dtype
(token ids, masks) crosses them unchanged, as with `none`. Scales are float32 (not
fp16) because gradients reach magnitudes where fp16 scales underflow. A NaN or inf
value poisons its own block (its scale, hence every value it decodes, is non-finite),
never the others, and is never turned into a finite value. The quantisation itself lives in `quantize.py`.

Contract: `encode` computes on the tensor's device and never modifies it;
`payload_specs(shape, dtype)` are exactly the payloads' shapes and dtypes, so the
receiver preallocates them; `decode` returns the original shape and dtype on the
payloads' device and never modifies the payloads; `wire_bytes` is the payloads' size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from hetlaunch.runtime import quantize as qz
from hetlaunch.runtime.wire import CODEC_WIRE_IDS, codec_name

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

    name = "none"
    wire_id = CODEC_WIRE_IDS[name]

    def encode(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.contiguous()]

    def payload_specs(self, shape, dtype):
        return [(tuple(shape), dtype)]

    def decode(self, payloads, shape, dtype):
        return payloads[0]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _FloatOnlyCodec(Codec):
    """A lossy codec for floating-point tensors that lets every other dtype cross unchanged."""

    @abstractmethod
    def _encode(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    @abstractmethod
    def _payload_specs(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[PayloadSpec]: ...

    @abstractmethod
    def _decode(self, payloads: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def encode(self, tensor):
        if not tensor.dtype.is_floating_point:
            return [tensor.contiguous()]
        return self._encode(tensor.detach())  # out= ops refuse tensors that require grad

    def payload_specs(self, shape, dtype):
        if not dtype.is_floating_point:
            return [(tuple(shape), dtype)]
        return self._payload_specs(tuple(shape), dtype)

    def decode(self, payloads, shape, dtype):
        if not dtype.is_floating_point:
            return payloads[0]
        return self._decode(payloads, tuple(shape), dtype)


class CastCodec(_FloatOnlyCodec):
    """Sends the tensor cast to a 16-bit float dtype (float16 overflows to inf past +-65504; bfloat16 does not)."""

    def __init__(self, name: str, wire_dtype: torch.dtype):
        self.name, self.wire_id, self.wire_dtype = name, CODEC_WIRE_IDS[name], wire_dtype

    def _encode(self, tensor):
        return [tensor.to(self.wire_dtype, memory_format=torch.contiguous_format)]

    def _payload_specs(self, shape, dtype):
        return [(shape, self.wire_dtype)]

    def _decode(self, payloads, shape, dtype):
        return payloads[0].to(dtype).view(shape)


class BlockwiseIntCodec(_FloatOnlyCodec):
    """Blockwise absmax integer quantisation (int8, or int4 two to a byte), optionally rotated first.

    Payloads: [q, scales] with q int8 (nb, block) or uint8 (nb, block/2) and scales float32
    (nb,), nb = ceil(numel / block); the last block is zero-padded. Per value the error is
    at most half a step, absmax/(2*qmax) of its block (in the rotated basis when rotated).
    """

    def __init__(self, name: str, bits: int, rotate: bool, block: int = qz.BLOCK,
                 seed: int = qz.SIGN_SEED, rotation_method: str = "matmul"):
        self.name, self.wire_id, self.bits, self.block = name, CODEC_WIRE_IDS[name], bits, block
        self.rotation = qz.BlockRotation(block, seed, rotation_method) if rotate else None

    def _encode(self, tensor):
        return list(qz.quantize(tensor, self.bits, self.block, self.rotation))

    def _payload_specs(self, shape, dtype):
        return qz.payload_shapes(_numel(shape), self.bits, self.block)

    def _decode(self, payloads, shape, dtype):
        q, scales = payloads
        return qz.dequantize(q, scales, _numel(shape), dtype, self.bits, self.block, self.rotation).view(shape)


# One implementation per name in runtime/registry.py (tests/stage/test_registry.py checks both ways).
CODECS_BY_NAME: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        NoneCodec(),
        CastCodec("fp16", torch.float16),
        CastCodec("bf16", torch.bfloat16),
        BlockwiseIntCodec("int8", bits=8, rotate=False),
        BlockwiseIntCodec("int4", bits=4, rotate=False),
        BlockwiseIntCodec("int4_rotated", bits=4, rotate=True),
    )
}
CODECS: dict[int, Codec] = {codec.wire_id: codec for codec in CODECS_BY_NAME.values()}


def codec_by_id(wire_id: int) -> Codec:
    return CODECS_BY_NAME[codec_name(wire_id)]


def codec_by_name(name: str) -> Codec:
    try:
        return CODECS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(sorted(CODECS_BY_NAME))})") from None
