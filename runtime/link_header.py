"""The header every element of a stage-link message starts with (runtime/link.py): a fixed-size
int64 tensor naming the format version, codec, dtype, send time, tuple position and count, the
complex flag, the layout-notice flag and the shape. Only tensors cross: nothing is pickled. A
receiver checks a header against its link's bound before it allocates anything for the message."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetlaunch.runtime.codecs import Codec, codec_by_id

HEADER_VERSION = 3  # 2: tuple position and count, complex flag; 3: notice of the next layout
MAX_DIMS = 8
# version, codec, dtype, send time (us), position, count, complex, notice, ndim, dims...
HEADER_LEN = 9 + MAX_DIMS
# A message's count: 0 for a lone tensor, n for element `position` of an n-tuple.
Message = torch.Tensor | tuple[torch.Tensor, ...]

MAX_TUPLE = 64  # tensors in one boundary message
# Never allocate more than this for one received tensor, whatever a header says; a plan sets a
# tighter bound per link from the profiled boundary (LinkSpec.max_message_bytes).
HARD_MAX_MESSAGE_BYTES = 16 * 2**30

# Wire codes for dtypes; append only, the numbers are part of the protocol.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.uint8: 7,
    torch.int8: 8,
    torch.bool: 9,
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def encode_header(codec: Codec, shape: tuple[int, ...], dtype: torch.dtype, sent_at: float = 0.0,
                  position: int = 0, count: int = 0, complex_: bool = False, notice: bool = False) -> torch.Tensor:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"tensors of more than {MAX_DIMS} dims cannot cross a link (got {len(shape)})")
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} cannot cross a link")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = HEADER_VERSION
    header[1] = codec.wire_id
    header[2] = DTYPE_CODES[dtype]
    header[3] = int(sent_at * 1e6)  # wall clock, read only by an emulated link on the same machine
    header[4] = position
    header[5] = count
    header[6] = int(complex_)
    header[7] = int(notice)  # this header only announces the layout of the next message at its position
    header[8] = len(shape)
    if shape:
        header[9 : 9 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return header


@dataclass(frozen=True)
class Header:
    codec: Codec
    shape: tuple[int, ...]   # of the real view, for a complex tensor
    dtype: torch.dtype
    sent_at: float
    position: int = 0
    count: int = 0
    complex_: bool = False
    notice: bool = False


def decode_header(header: torch.Tensor) -> Header:
    values = header.tolist()
    if values[0] != HEADER_VERSION:
        raise ValueError(f"link header version {values[0]} (expected {HEADER_VERSION}): peers run different hetlaunch versions")
    position, count, complex_, notice, ndim = values[4:9]
    if (not 0 <= ndim <= MAX_DIMS or any(d < 0 for d in values[9 : 9 + ndim]) or values[2] not in DTYPES_BY_CODE or not 0 <= count <= MAX_TUPLE
            or not (position == 0 if count == 0 else 0 <= position < count) or complex_ not in (0, 1) or notice not in (0, 1)):
        raise ValueError(f"corrupt link header {values}")
    return Header(codec_by_id(values[1]), tuple(values[9 : 9 + ndim]), DTYPES_BY_CODE[values[2]], values[3] / 1e6,
                  position, count, bool(complex_), bool(notice))


def payload_layout(head: Header) -> tuple[int, ...]:
    """The byte size of each payload the header's message carries: what the receiver posts."""
    return tuple(dtype.itemsize * numel(shape) for shape, dtype in head.codec.payload_specs(head.shape, head.dtype))


def check_message_size(head: Header, max_bytes: int, peer_rank: int, used: int = 0) -> int:
    """Refuse a header whose tensor would take its message past the `max_bytes` this link accepts
    (`used`: what the message's earlier tuple elements took), before allocating for it; its size
    in bytes. The bound holds for a whole tuple, not each element: a 64-tuple of tensors each
    at the bound was 64 times it. A zero dim counts as 1 here, so an empty tensor cannot announce
    dims that model code dropping the zero would then allocate (0 x 2**62 arrived as valid)."""
    size = spread = head.dtype.itemsize
    for dim in head.shape:
        size *= dim
        spread *= max(dim, 1)
    if used + spread > max_bytes:
        counted = " (a zero dim counted as 1)" if spread != size else ""
        before = f" after {used:,} bytes of its message" if used else ""
        raise ValueError(f"rank {peer_rank} announced a {spread:,}-byte tensor {list(head.shape)}{counted}{before}, "
                         f"over the {max_bytes:,} bytes this link accepts in a message (the profiled boundary, "
                         f"with room)")
    return size


def numel(shape) -> int:
    """Elements of a tensor of `shape` (a header's)."""
    count = 1
    for dim in shape:
        count *= int(dim)
    return count
