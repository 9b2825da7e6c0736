"""Codecs: registry against the wire enum, bytes on the wire, round-trip error bounds, edge cases, wire format.

Error bounds used below, per value x of a block whose absmax is a (b = 64 values a block):

- int8 / int4 (absmax, round to nearest): q = round(x * qmax / a) with |x * qmax / a - q| <= 1/2,
  so |q * a / qmax - x| <= a / (2 * qmax): a/254 for int8 (qmax 127), a/14 for int4 (qmax 7).
- int4_rotated: the same holds for every value of the rotated block y = R x (R = H·D/sqrt(b)
  orthogonal) with a_y = max|y|: |e_i| <= a_y / 14. Decoding applies R^T, which keeps the
  Euclidean norm, so per block ||x_hat - x||_2 = ||e||_2 <= sqrt(b) * a_y / 14. (A per-value
  bound a_y/14 does not hold: rotating back mixes the b errors of a block into every value.)
- fp16 / bf16 (round to nearest): |x_hat - x| <= |x| * u with u = 2^-11 (fp16) or 2^-8 (bf16)
  for values in the normal range, plus half the smallest subnormal (2^-25) for fp16.
- Decoding into a 16-bit dtype rounds once more: add |x_hat| * u of that dtype.
Each float32 computation (the scale, its reciprocal, the product, the 64-term rotation)
adds relative rounding of a few 2^-24 of a; SLACK = 1e-4 of a covers that generously while
staying far below the bounds above.
"""

from __future__ import annotations

import math

import pytest
import torch

from hetlaunch.protos import control_pb2
from hetlaunch.runtime import quantize as qz
from hetlaunch.runtime.codecs import CODECS, CODECS_BY_NAME, BlockwiseIntCodec, codec_by_id, codec_by_name

B = qz.BLOCK
SLACK = 1e-4
NAMES = ["none", "fp16", "bf16", "int8", "int4", "int4_rotated"]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}
QMAX = {"int8": 127, "int4": 7, "int4_rotated": 7}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def normal(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed)) * 3


def student_t2(shape, seed=0) -> torch.Tensor:
    """Student-t with 2 degrees of freedom (infinite variance): z / sqrt(chi2_2 / 2)."""
    g = _gen(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn(shape, generator=g) ** 2 + torch.randn(shape, generator=g) ** 2
    return z / (chi2 / 2).sqrt()


def with_outliers(shape, seed=0) -> torch.Tensor:
    """Normal values with about 1 in 800 multiplied by 100."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g)
    n = x.numel()
    x.view(-1)[torch.randint(0, n, (max(1, n // 800),), generator=g)] *= 100
    return x


def round_trip(codec, x):
    payloads = codec.encode(x)
    return payloads, codec.decode(payloads, tuple(x.shape), x.dtype)


def specs_of(payloads) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(p.shape), p.dtype) for p in payloads]


def padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """x flattened into float64 blocks of B, zero-padded: what the quantiser sees."""
    flat = x.reshape(-1).double()
    nb = qz.num_blocks(flat.numel())
    out = torch.zeros(nb * B, dtype=torch.float64)
    out[: flat.numel()] = flat
    return out.view(nb, B)


def reference_rotation() -> torch.Tensor:
    """R^T = D·H/sqrt(b) built independently of the codec: H by Kronecker products, in float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < B:
        h = torch.kron(h2, h)
    return qz.random_signs(B, qz.SIGN_SEED).double()[:, None] * h / math.sqrt(B)


def formula_wire_bytes(name: str, shape, dtype) -> int:
    n = math.prod(shape)
    nb = -(-n // B)  # ceil(n / 64) blocks
    if name == "none" or not dtype.is_floating_point:
        return n * dtype.itemsize
    return {
        "fp16": 2 * n,
        "bf16": 2 * n,
        "int8": nb * B + 4 * nb,  # one int8 per value, padding included, one float32 scale per block
        "int4": nb * B // 2 + 4 * nb,  # two values per byte
        "int4_rotated": nb * B // 2 + 4 * nb,
    }[name]


# ---------------------------------------------------------------- registry


def test_every_wire_value_has_its_codec():
    values = [v for v in control_pb2.Codec.values() if v != control_pb2.CODEC_UNSPECIFIED]
    assert len(values) == len(NAMES)
    for value in values:
        codec = codec_by_id(value)
        assert codec is CODECS[value] and codec.wire_id == value
        assert codec_by_name(codec.name) is codec
        assert control_pb2.Codec.Name(value) == "CODEC_" + codec.name.upper()
    assert sorted(CODECS_BY_NAME) == sorted(NAMES)
    assert control_pb2.CODEC_UNSPECIFIED not in CODECS


def test_unknown_codecs_are_refused():
    with pytest.raises(ValueError, match="unknown codec id 999"):
        codec_by_id(999)
    with pytest.raises(ValueError, match="int3"):
        codec_by_name("int3")


# ---------------------------------------------------------------- wire bytes and payload specs

SHAPES = [(4, 16, 32), (3, 5, 7), (65,), (63,), (1,), (), (0,), (3, 0, 5), (2, 1000)]


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_payloads_match_specs_and_wire_bytes_formula(name, shape, dtype):
    codec = codec_by_name(name)
    x = normal(shape).to(dtype) if dtype.is_floating_point else torch.randint(-5, 5, shape, generator=_gen())
    payloads, decoded = round_trip(codec, x)
    assert specs_of(payloads) == [(tuple(s), d) for s, d in codec.payload_specs(shape, dtype)]
    actual = sum(p.numel() * p.element_size() for p in payloads)
    assert codec.wire_bytes(shape, dtype) == actual == formula_wire_bytes(name, shape, dtype)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype and decoded.device == payloads[0].device
    if not dtype.is_floating_point:  # lossy codecs leave token ids, masks, ... unchanged
        assert torch.equal(decoded, x)


def test_compression_ratios_of_an_activation():
    shape = (8, 128, 512)
    raw = math.prod(shape) * 4
    ratios = {name: raw / codec_by_name(name).wire_bytes(shape, torch.float32) for name in NAMES}
    assert ratios == pytest.approx({"none": 1, "fp16": 2, "bf16": 2, "int8": 256 / 68, "int4": 256 / 36,
                                    "int4_rotated": 256 / 36})


# ---------------------------------------------------------------- error bounds


def assert_levels_in_range(name: str, q: torch.Tensor) -> None:
    if name == "int8":
        assert q.dtype == torch.int8 and int(q.min()) >= -127 and int(q.max()) <= 127
    elif name.startswith("int4"):  # nibbles hold q + 8 with q in [-7, 7]: 1..15, never 0
        assert q.dtype == torch.uint8
        for nibble in (q & 15, q >> 4):
            assert int(nibble.min()) >= 1 and int(nibble.max()) <= 15


def assert_within_bounds(name: str, x: torch.Tensor, payloads, decoded: torch.Tensor) -> None:
    assert_levels_in_range(name, payloads[0])
    x64, d64 = x.double(), decoded.double()
    u_out = UNIT_ROUNDOFF[x.dtype] if x.dtype != torch.float32 else 0.0  # decoding rounds into x's dtype
    err = (d64 - x64).abs()
    if name == "none":
        assert torch.equal(decoded, x)
    elif name in ("fp16", "bf16"):
        wire = torch.float16 if name == "fp16" else torch.bfloat16
        u = UNIT_ROUNDOFF[wire]
        assert (err <= x64.abs() * u + 2.0**-25 + d64.abs() * u_out).all()
    elif name in ("int8", "int4"):
        blocks = padded_blocks(x)
        absmax = blocks.abs().amax(dim=1)
        bound = (absmax * (1 / (2 * QMAX[name]) + SLACK))[:, None].expand(-1, B).reshape(-1)[: x.numel()]
        assert (err.reshape(-1) <= bound + d64.abs().reshape(-1) * u_out).all()
        # The scale on the wire is absmax / qmax, in float32.
        scales = payloads[1].double()
        assert torch.allclose(scales, absmax.clamp_min(qz.TINY) / QMAX[name], rtol=1e-6, atol=0)
    else:  # int4_rotated
        blocks = padded_blocks(x)
        rotated = blocks @ reference_rotation()
        a_y = rotated.abs().amax(dim=1)
        assert torch.allclose(payloads[1].double(), a_y.clamp_min(qz.TINY) / 7, rtol=1e-5, atol=0)
        err_blocks = padded_blocks(d64 - x64)
        block_l2 = err_blocks.norm(dim=1)
        out_rounding = padded_blocks(d64).norm(dim=1) * u_out
        assert (block_l2 <= a_y * (math.sqrt(B) / 14 + SLACK) + out_rounding).all()


DISTRIBUTIONS = {"normal": normal, "student_t2": student_t2, "outliers": with_outliers}


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_error_within_bound(name, dist, dtype):
    codec = codec_by_name(name)
    for shape in [(4, 16, 32), (3, 5, 7), (1000,)]:  # the last two end in a partial block
        x = DISTRIBUTIONS[dist](shape).to(dtype)
        payloads, decoded = round_trip(codec, x)
        assert decoded.dtype == dtype and decoded.shape == x.shape
        assert torch.isfinite(decoded).all()
        assert_within_bounds(name, x, payloads, decoded)


# Expected relative RMS errors on normal data, for a regression guard: uniform rounding error
# of a step s = a/qmax has RMS s/sqrt(12); for 64 normal values a is about 2.4 sigma, so
# int8 ~ 2.4/127/3.46 = 0.55 %, int4 ~ 2.4/7/3.46 = 10 %. Rotated normal data is still normal.
REL_RMS_NORMAL_MAX = {"none": 0.0, "fp16": 3e-4, "bf16": 2.5e-3, "int8": 0.008, "int4": 0.13, "int4_rotated": 0.13}


@pytest.mark.parametrize("name", NAMES)
def test_relative_rms_error_on_normal_data(name):
    x = normal((64, 1024), seed=3)
    _, decoded = round_trip(codec_by_name(name), x)
    rel = float((decoded - x).norm() / x.norm())
    assert rel <= REL_RMS_NORMAL_MAX[name]


@pytest.mark.parametrize("dist", ["student_t2", "outliers"])
def test_rotation_lowers_int4_error_on_heavy_tails(dist):
    x = DISTRIBUTIONS[dist]((64, 1024), seed=5)
    mse = {}
    for name in ("int4", "int4_rotated"):
        _, decoded = round_trip(codec_by_name(name), x)
        mse[name] = float((decoded.double() - x.double()).pow(2).mean())
    # Measured ratios are ~0.27 (student_t2) and ~0.42 (outliers); require strictly lower with margin.
    assert mse["int4_rotated"] < 0.7 * mse["int4"], mse


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_zero_dim_tensors(name):
    codec = codec_by_name(name)
    for shape in [(0,), (3, 0, 5), (0, 64)]:
        x = torch.empty(shape)
        payloads, decoded = round_trip(codec, x)
        assert decoded.shape == shape and decoded.dtype == x.dtype
        assert codec.wire_bytes(shape, x.dtype) == 0
    x = torch.tensor(-2.5)
    payloads, decoded = round_trip(codec, x)
    assert decoded.shape == () and decoded.dtype == torch.float32
    assert decoded.item() == pytest.approx(-2.5, rel=1e-6)  # a lone value is its block's absmax: exact


@pytest.mark.parametrize("name", ["int8", "int4", "int4_rotated"])
def test_zero_and_tiny_blocks_decode_without_nan(name):
    codec = codec_by_name(name)
    x = normal((4, B))
    x[1] = 0.0  # an all-zero block
    x[2] = 1e-40  # a block of float32 denormals
    x[3, :5] = 1e-30
    x[3, 5:] = 0.0
    payloads, decoded = round_trip(codec, x)
    assert torch.isfinite(decoded).all()
    assert torch.equal(decoded[1], torch.zeros(B))
    # Well-defined integers (no NaN/inf cast to int): an all-zero block is all level 0.
    zero_level = torch.zeros_like(payloads[0][1]) + (0 if name == "int8" else 0x88)
    assert torch.equal(payloads[0][1], zero_level)
    assert_levels_in_range(name, payloads[0])
    assert (payloads[1] > 0).all() and torch.isfinite(payloads[1]).all()
    assert (decoded[2:] - x[2:]).abs().max() <= 1e-30
    # A receiver given a scale of exactly 0 (another encoder) decodes zeros, not NaN.
    q, scales = payloads
    scales = scales.clone()
    scales[0] = 0.0
    again = codec.decode([q, scales], tuple(x.shape), x.dtype)
    assert torch.equal(again[0], torch.zeros(B)) and torch.isfinite(again).all()
    assert torch.equal(codec.decode(codec.encode(torch.zeros(5, 7)), (5, 7), torch.float32), torch.zeros(5, 7))


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int4", "int4_rotated"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_poison_only_their_block(name, bad):
    codec = codec_by_name(name)
    x = normal((3, B))
    x[1, 7] = bad
    clean = x.clone()
    clean[1] = 0.0
    _, decoded = round_trip(codec, x)
    _, reference = round_trip(codec, clean)
    assert torch.equal(decoded[[0, 2]], reference[[0, 2]])  # other blocks as if nothing happened
    assert not torch.isfinite(decoded[1, 7])
    if name.startswith("int"):  # the scale is poisoned: no value of the block claims to be finite
        assert not torch.isfinite(decoded[1]).any()


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_inputs_encode_like_their_contiguous_copy(name):
    codec = codec_by_name(name)
    base = normal((48, 40, 3))
    for view in (base.transpose(0, 1), base[::2, 1:], base[..., 1], base.permute(2, 0, 1)):
        assert not view.is_contiguous()
        before = view.clone()
        payloads = codec.encode(view)
        expected = codec.encode(view.contiguous())
        assert all(torch.equal(p, e) for p, e in zip(payloads, expected, strict=True))
        assert torch.equal(view, before)  # the input is not modified
        decoded = codec.decode(payloads, tuple(view.shape), view.dtype)
        assert decoded.shape == view.shape and decoded.is_contiguous()


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_leaves_payloads_alone(name):
    codec = codec_by_name(name)
    x = student_t2((5, 333), seed=7)
    first, second = codec.encode(x), codec.encode(x)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    copies = [p.clone() for p in first]
    d1 = codec.decode(first, tuple(x.shape), x.dtype)
    d2 = codec.decode(first, tuple(x.shape), x.dtype)
    assert torch.equal(d1, d2)
    assert all(torch.equal(p, c) for p, c in zip(first, copies, strict=True))


@pytest.mark.parametrize("name", NAMES)
def test_codecs_stay_on_the_tensors_device(name):
    """The meta device runs every op without data: nothing may move a tensor to the CPU."""
    codec = codec_by_name(name)
    x = torch.empty((5, 70), device="meta")
    payloads = codec.encode(x)
    assert all(p.device.type == "meta" for p in payloads)
    assert specs_of(payloads) == [(tuple(s), d) for s, d in codec.payload_specs((5, 70), x.dtype)]
    assert codec.decode(payloads, (5, 70), x.dtype).device.type == "meta"


@pytest.mark.parametrize("name", NAMES)
def test_tensors_that_require_grad_encode(name):
    x = normal((3, 100)).requires_grad_()
    codec = codec_by_name(name)
    decoded = codec.decode([p.detach() for p in codec.encode(x)], (3, 100), x.dtype)
    assert decoded.shape == x.shape and not decoded.requires_grad


@pytest.mark.parametrize("name", NAMES)
def test_float64_inputs_round_trip_within_bound(name):
    """Computed in float32: rounding x to float32 adds 2^-24 |x|, inside SLACK."""
    x = student_t2((3, 100)).double()
    payloads, decoded = round_trip(codec_by_name(name), x)
    assert decoded.dtype == torch.float64
    assert_within_bounds(name, x, payloads, decoded)


# ---------------------------------------------------------------- wire format


def test_int4_nibble_layout():
    """Byte i of a block holds value i in its low nibble and value i + 32 in its high one, each as q + 8."""
    levels = torch.tensor([7, -7, 0, 1, -1, 3, 2, -5] * 8, dtype=torch.float32)  # absmax 7: scale exactly 1
    levels[40:48] = torch.arange(-7, 1)
    q, scales = codec_by_name("int4").encode(levels)
    assert scales.tolist() == [1.0]
    u = (levels + 8).to(torch.uint8)
    assert torch.equal(q[0], u[:32] | (u[32:] << 4))
    assert q[0, 8] == (7 + 8) | ((-7 + 8) << 4) == 0x1F  # values 8 and 40: 7 and -7
    q8, scales8 = codec_by_name("int8").encode(levels * (127 / 7))
    assert torch.equal(q8[0], (levels * (127 / 7)).round().to(torch.int8)) and scales8.tolist() == [1.0]


def test_rotation_signs_are_pinned():
    """The seeded signs are part of the wire format: changing them breaks every peer on the old ones."""
    signs = "".join("+" if s > 0 else "-" for s in qz.random_signs(B, qz.SIGN_SEED).tolist())
    assert signs == "--------+-----+++--++-++-++---+++--------------+-----++--+++-+--"
    assert qz.SIGN_SEED == 0x5EED


def test_fwht_matches_the_hadamard_matrix_and_rotation_is_orthogonal():
    x = normal((7, 3, B))
    h = reference_rotation() / qz.random_signs(B).double()[:, None] * math.sqrt(B)
    assert torch.allclose(qz.fwht(x).double(), x.double() @ h, atol=1e-4)
    assert torch.equal(qz.hadamard_matrix(B).double(), h)
    r = reference_rotation()
    assert torch.allclose(r @ r.T, torch.eye(B, dtype=torch.float64), atol=1e-12)
    for method in ("matmul", "fwht"):
        rot = qz.BlockRotation(B, qz.SIGN_SEED, method)
        rows = x.view(-1, B)
        y, back = torch.empty_like(rows), torch.empty_like(rows)
        rot.forward(rows, out=y)
        rot.inverse(y, out=back)
        assert torch.allclose(y.double(), rows.double() @ r, atol=1e-5)
        assert torch.allclose(back, rows, atol=1e-5)


def test_fwht_and_matmul_rotations_are_wire_compatible():
    fwht_codec = BlockwiseIntCodec("int4_rotated", bits=4, rotate=True,
                                   rotation_method="fwht")
    matmul_codec = codec_by_name("int4_rotated")
    x = student_t2((6, 200), seed=11)
    from_fwht = fwht_codec.encode(x)
    from_matmul = matmul_codec.encode(x)
    assert torch.allclose(from_fwht[1], from_matmul[1], rtol=1e-5)
    # Rounding may flip a value that sits on a level boundary; nearly all must agree.
    assert (from_fwht[0] == from_matmul[0]).float().mean() > 0.99
    shape = tuple(x.shape)
    a = matmul_codec.decode(from_fwht, shape, x.dtype)
    b = fwht_codec.decode(from_fwht, shape, x.dtype)
    assert torch.allclose(a, b, atol=1e-5 * float(x.abs().max()))


def test_int_codecs_refuse_payloads_of_the_wrong_size():
    codec = codec_by_name("int8")
    q, scales = codec.encode(normal((2, B)))
    with pytest.raises(ValueError, match="blocks"):
        codec.decode([q, scales], (3, B), torch.float32)
