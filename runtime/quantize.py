"""Blockwise absmax quantisation and the seeded block Hadamard rotation behind the int codecs.

A tensor is flattened and cut into blocks of `block` consecutive values (the last block
zero-padded; padding is never decoded into the output). Each block gets one float32 scale
`absmax / qmax` and its values are rounded to the nearest integer in [-qmax, qmax]:
int8 (qmax 127) keeps one signed byte per value; int4 (qmax 7) keeps `q + 8` (1..15) as
an unsigned nibble, two per byte: byte i of a block holds value i in its low nibble and
value i + block/2 in its high nibble (pairing the two halves of a block keeps every
packing op on contiguous runs; pairing neighbours made that op about 3x slower on CPU).

The optional rotation multiplies every block by R = H·D/sqrt(block) before quantising
(H the Sylvester Hadamard matrix, D a fixed diagonal of random signs): R is orthogonal,
so decoding applies R^T and an outlier's energy is spread over its whole block instead
of coarsening the scale for its neighbours. The signs come from a splitmix64 stream,
not from torch's RNG, so they cannot change with the torch version: they are part of
the wire format.

Everything is vectorised torch on the tensor's own device. On CPU the work runs in
chunks of rows so that temporaries stay in cache (measured 1.3-2.7x faster than
whole-tensor ops, which fault fresh pages for every temporary); on accelerators one
chunk is the whole tensor.
"""

from __future__ import annotations

import math

import torch

from hetlaunch.runtime.registry import QUANT_BLOCK

BLOCK = QUANT_BLOCK  # values per scale; the planner sizes payloads with the same block
SIGN_SEED = 0x5EED
CPU_CHUNK_VALUES = 1 << 17  # values per chunk on CPU: 512 KiB of float32 temporaries, fits L2
# Smallest absmax used for a scale: an all-zero (or denormal) block gets scale TINY/qmax
# instead of 0, so 1/scale stays finite, nothing divides by zero and zeros decode as 0.
TINY = 2.0**-100

_MASK64 = (1 << 64) - 1


def num_blocks(numel: int, block: int = BLOCK) -> int:
    return -(-numel // block)


def _chunk_rows(device: torch.device, rows: int, block: int) -> int:
    if device.type == "cpu":
        return max(1, CPU_CHUNK_VALUES // block)
    return max(1, rows)


# ---------------------------------------------------------------- rotation


def random_signs(block: int, seed: int = SIGN_SEED) -> torch.Tensor:
    """`block` values of +-1.0 (float32, CPU) from splitmix64(seed): identical on every host."""
    state = seed & _MASK64
    signs = []
    for _ in range(block):  # `block` scalars once per process, cached by the callers
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        signs.append(1.0 if z >> 63 else -1.0)
    return torch.tensor(signs, dtype=torch.float32)


def hadamard_matrix(block: int) -> torch.Tensor:
    """Sylvester Hadamard matrix (entries +-1, symmetric, H @ H = block * I), float32, CPU."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"Hadamard block must be a power of two, got {block}")
    idx = torch.arange(block)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    for bit in range(max(1, block.bit_length() - 1)):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).to(torch.float32)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh-Hadamard transform over the last dim (a power of two).

    log2(b) butterfly stages, each two whole-tensor ops on a (..., b/2h, 2, h) view; the
    result equals `x @ hadamard_matrix(b)`. Returns a new tensor; `x` is not modified.
    """
    b = x.shape[-1]
    if b < 1 or b & (b - 1):
        raise ValueError(f"fwht needs a power-of-two last dim, got {b}")
    lead = x.shape[:-1]
    src = x.contiguous()
    bufs = [torch.empty_like(src), torch.empty_like(src)]
    h, i = 1, 0
    while h < b:
        s = src.view(*lead, b // (2 * h), 2, h)
        d = bufs[i].view(*lead, b // (2 * h), 2, h)
        torch.add(s[..., 0, :], s[..., 1, :], out=d[..., 0, :])
        torch.sub(s[..., 0, :], s[..., 1, :], out=d[..., 1, :])
        src, i, h = bufs[i], i ^ 1, h * 2
    return src if src is not x else src.clone()


class BlockRotation:
    """R = H·D/sqrt(b) applied to rows of b values: `forward` is x @ R^T, `inverse` is y @ R.

    method "matmul" multiplies by the cached b x b matrix (one GEMM: on CPU about 8x faster
    than the log2(b) memory passes of the FWHT in eager torch, see bench/codec_throughput.py);
    method "fwht" uses `fwht`. Both compute the same orthogonal map up to float rounding,
    so a sender and a receiver may use different methods. (Where float32 matmuls are
    allowed TF32, the GEMM rounds to about 1e-3 relative: far below an int4 step.)
    """

    def __init__(self, block: int = BLOCK, seed: int = SIGN_SEED, method: str = "matmul"):
        if method not in ("matmul", "fwht"):
            raise ValueError(f"rotation method must be 'matmul' or 'fwht', got {method!r}")
        self.block, self.seed, self.method = block, seed, method
        self.signs = random_signs(block, seed)
        h = hadamard_matrix(block) / math.sqrt(block)
        self.forward_matrix = (self.signs[:, None] * h).contiguous()  # R^T = D H / sqrt(b)
        self.inverse_matrix = self.forward_matrix.t().contiguous()  # R = H D / sqrt(b)
        self._cache: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _on(self, what: str, device: torch.device) -> torch.Tensor:
        key = (what, device)
        if key not in self._cache:
            cpu = {"fwd": self.forward_matrix, "inv": self.inverse_matrix, "signs": self.signs}[what]
            self._cache[key] = cpu.to(device)
        return self._cache[key]

    def forward(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """rows (r, b) float32 -> out (r, b) float32 = rows @ R^T. `out` must not alias `rows`."""
        if self.method == "matmul":
            return torch.mm(rows, self._on("fwd", rows.device), out=out)
        y = fwht(rows * self._on("signs", rows.device))
        return torch.mul(y, 1.0 / math.sqrt(self.block), out=out)

    def inverse(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """rows (r, b) float32 -> out (r, b) = rows @ R (cast to out's dtype). `out` must not alias `rows`."""
        if self.method == "matmul":
            if out.dtype == torch.float32:
                return torch.mm(rows, self._on("inv", rows.device), out=out)
            return out.copy_(torch.mm(rows, self._on("inv", rows.device)))
        y = fwht(rows)
        return torch.mul(y, self._on("signs", rows.device) / math.sqrt(self.block), out=out)


# ---------------------------------------------------------------- quantise / dequantise


def _quantize_rows(src: torch.Tensor, qmax: int, rotation: BlockRotation | None,
                   q_out: torch.Tensor, s_out: torch.Tensor, work: torch.Tensor, half: torch.Tensor | None) -> None:
    """Quantise rows (r, b) of any float dtype into q_out (int8 (r, b) or packed uint8 (r, b/2)) and s_out (r,)."""
    if rotation is not None:
        rotation.forward(src if src.dtype == torch.float32 else src.float(), out=work)
        src = work
    elif src.dtype != torch.float32:  # float32 first: CPU reductions over 16-bit floats are ~4x slower
        src = work.copy_(src)
    absmax = torch.maximum(src.amax(dim=1), src.amin(dim=1).neg_()).float().clamp_min_(TINY)
    torch.div(absmax, qmax, out=s_out)
    torch.mul(src, torch.reciprocal(s_out)[:, None], out=work)  # |work| <= qmax (+ rounding); mixed dtypes in float32
    work.round_()
    if half is None:  # int8
        q_out.copy_(work)
        return
    # int4: v = q_lo + 16 q_hi in [-119, 119] is exact in float32 and fits int8 (whose casts are fast,
    # unlike float -> uint8); adding 136 to its bits modulo 256 gives (q_lo + 8) + 16 (q_hi + 8).
    h = work.shape[1] // 2
    torch.add(work[:, :h], work[:, h:], alpha=16, out=half)
    q_out.view(torch.int8).copy_(half)
    q_out.add_(136)  # uint8 arithmetic wraps modulo 256


def quantize(x: torch.Tensor, bits: int, block: int = BLOCK, rotation: BlockRotation | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) for a float tensor of any shape, layout and numel; on x's device.

    bits 8: q int8 (num_blocks, block) in [-127, 127]; bits 4: q uint8 (num_blocks, block/2).
    scales float32 (num_blocks,). x is read, never modified.
    """
    qmax, cols, qdtype = _format(bits, block)
    flat = x.reshape(-1)  # a view when x is contiguous
    n, device = flat.numel(), x.device
    nb, full = num_blocks(n, block), n // block
    q = torch.empty((nb, cols), dtype=qdtype, device=device)
    scales = torch.empty(nb, dtype=torch.float32, device=device)
    if nb == 0:
        return q, scales
    step = _chunk_rows(device, nb, block)
    work = torch.empty((min(step, nb), block), dtype=torch.float32, device=device)
    half = torch.empty((work.shape[0], block // 2), dtype=torch.float32, device=device) if bits == 4 else None
    for start in range(0, full, step):
        stop = min(start + step, full)
        r = stop - start
        _quantize_rows(flat[start * block: stop * block].view(r, block), qmax, rotation,
                       q[start:stop], scales[start:stop], work[:r], None if half is None else half[:r])
    if full < nb:  # the last, partial block, zero-padded
        tail = torch.zeros((1, block), dtype=flat.dtype, device=device)
        tail.view(-1)[: n - full * block] = flat[full * block:]
        _quantize_rows(tail, qmax, rotation, q[full:], scales[full:], work[:1], None if half is None else half[:1])
    return q, scales


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, bits: int, rotation: BlockRotation | None,
                     out: torch.Tensor, work: torch.Tensor, nibbles: torch.Tensor | None) -> None:
    if bits == 4:  # nibbles (r, 2, b/2): low nibbles are values 0..b/2-1, high ones b/2..b-1
        torch.bitwise_and(q, 15, out=nibbles[:, 0])
        torch.bitwise_right_shift(q, 4, out=nibbles[:, 1])
        q = nibbles.view(torch.int8).sub_(8).view(q.shape[0], -1)  # 0..15 read the same as int8
    if rotation is None:
        torch.mul(q, scales[:, None], out=out)  # int * float32 scale, cast once into out's dtype
    else:
        torch.mul(q, scales[:, None], out=work)
        rotation.inverse(work, out=out)


def dequantize(q: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype, bits: int,
               block: int = BLOCK, rotation: BlockRotation | None = None) -> torch.Tensor:
    """The flat tensor (numel,) of `dtype` on q's device; padding is dropped, q and scales are not modified."""
    device = q.device
    out = torch.empty(numel, dtype=dtype, device=device)
    nb, full = q.shape[0], numel // block
    if nb != num_blocks(numel, block):
        raise ValueError(f"{nb} blocks of payload for {numel} values (expected {num_blocks(numel, block)})")
    if nb == 0:
        return out
    step = _chunk_rows(device, nb, block)
    rows = min(step, nb)
    work = torch.empty((rows, block), dtype=torch.float32, device=device) if rotation is not None else None
    nibbles = torch.empty((rows, 2, block // 2), dtype=torch.uint8, device=device) if bits == 4 else None
    for start in range(0, full, step):
        stop = min(start + step, full)
        r = stop - start
        rows_out = out[start * block: stop * block].view(r, block)
        _dequantize_rows(q[start:stop], scales[start:stop], bits, rotation, rows_out,
                         None if work is None else work[:r], None if nibbles is None else nibbles[:r])
    if full < nb:
        tail = torch.empty((1, block), dtype=dtype, device=device)
        _dequantize_rows(q[full:], scales[full:], bits, rotation, tail,
                         None if work is None else work[:1], None if nibbles is None else nibbles[:1])
        out[full * block:] = tail.view(-1)[: numel - full * block]
    return out


def _format(bits: int, block: int) -> tuple[int, int, torch.dtype]:
    if bits == 8:
        return 127, block, torch.int8
    if bits == 4:
        if block % 2:
            raise ValueError(f"int4 needs an even block size, got {block}")
        return 7, block // 2, torch.uint8
    raise ValueError(f"bits must be 8 or 4, got {bits}")


def payload_shapes(numel: int, bits: int, block: int = BLOCK) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """What `quantize` returns for `numel` values: [(q shape, q dtype), (scales shape, float32)]."""
    _, cols, qdtype = _format(bits, block)
    nb = num_blocks(numel, block)
    return [((nb, cols), qdtype), ((nb,), torch.float32)]
