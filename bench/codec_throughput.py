"""Codec throughput on CPU: encode, decode and encode+decode GB/s per codec for activation-sized tensors.

GB/s counts the raw bytes of the tensor (numel * itemsize of its dtype) per second, so
codecs compare on the work they save a link, not on the bytes they write. One intra-op
thread; every figure is the median over repeats of one call (encode; decode of the same
payloads; encode followed by decode), the repeats going round-robin over the codecs so
that other load on the machine falls on all codecs alike. Each figure is also given per
second of this thread's CPU time, which leaves out time spent waiting for a core on a
shared machine. `none` is a no-op (its payload is the tensor itself): its figure is call
overhead, not bandwidth. The same run records each codec's compression ratio (raw bytes /
wire bytes) and its relative RMS error ||decode(encode(x)) - x|| / ||x|| on normal data
and on heavy-tailed data (Student-t, 2 degrees of freedom). The row `int4_rotated[fwht]`
is the int4_rotated codec with the rotation computed by the fast Walsh-Hadamard transform
instead of the 64x64 matrix product (same wire format).

    python bench/codec_throughput.py [--quick]    # prints a table, writes bench/results/codec_throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from hetlaunch.runtime import quantize as qz
from hetlaunch.runtime.codecs import CODECS, BlockwiseIntCodec, Codec

NAME = "codec_throughput"
RESULTS = Path(__file__).resolve().parent / "results"


def settings(quick: bool) -> dict:
    if quick:
        return {"shapes": [[8, 128, 512]], "dtypes": ["float32"], "repeats": 5}
    return {"shapes": [[8, 128, 512], [8, 512, 1024]], "dtypes": ["float32", "bfloat16"], "repeats": 21}


def codecs_under_test() -> list[tuple[str, Codec]]:
    rows = [(codec.name, codec) for _, codec in sorted(CODECS.items())]
    rows.append(("int4_rotated[fwht]", BlockwiseIntCodec("int4_rotated", bits=4,
                                                         rotate=True, rotation_method="fwht")))
    return rows


def _seconds(fn) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _rel_rms(codec: Codec, x: torch.Tensor) -> float:
    y = codec.decode(codec.encode(x), tuple(x.shape), x.dtype).double()
    ref = x.double()
    return float((y - ref).norm() / ref.norm())


def _student_t2(shape: list[int], gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(shape, generator=gen)
    chi2 = torch.randn(shape, generator=gen) ** 2 + torch.randn(shape, generator=gen) ** 2
    return z / (chi2 / 2).sqrt()


def measure(codecs: list[tuple[str, Codec]], x: torch.Tensor, heavy: torch.Tensor, repeats: int,
            reporter=None) -> list[dict]:
    """Figures for every codec on x. Repeats go round-robin over the codecs, so load from other
    work on the machine falls on all of them alike; each figure is the median over repeats."""
    shape, dtype = tuple(x.shape), x.dtype
    raw = x.numel() * x.element_size()
    payloads = {label: codec.encode(x) for label, codec in codecs}
    calls = {}
    for label, codec in codecs:
        calls[(label, "encode")] = lambda codec=codec: codec.encode(x)
        calls[(label, "decode")] = lambda codec=codec, p=payloads[label]: codec.decode(p, shape, dtype)
        calls[(label, "encode_decode")] = lambda codec=codec: codec.decode(codec.encode(x), shape, dtype)
    for fn in calls.values():
        fn()  # warm-up: caches, allocator, rotation matrices
    times = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            times[key].append(_seconds(fn))
    rows = []
    for label, codec in codecs:
        if reporter is not None:
            reporter.advance(f"{label} {list(shape)} {str(dtype).removeprefix('torch.')}")
        whats = ("encode", "decode", "encode_decode")
        med = {what: statistics.median(t[0] for t in times[(label, what)]) for what in whats}
        med_cpu = {what: statistics.median(t[1] for t in times[(label, what)]) for what in whats}
        wire = codec.wire_bytes(shape, dtype)
        rows.append({
            "codec": label, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
            "raw_bytes": raw, "wire_bytes": wire, "compression_ratio": round(raw / wire, 4),
            **{f"{what}_ms": round(t * 1e3, 3) for what, t in med.items()},
            **{f"{what}_gb_s": round(raw / t / 1e9, 3) for what, t in med.items()},
            **{f"{what}_gb_s_cpu_time": round(raw / max(t, 1e-9) / 1e9, 3) for what, t in med_cpu.items()},
            "rel_rms_error_normal": float(f"{_rel_rms(codec, x):.4g}"),
            "rel_rms_error_student_t2": float(f"{_rel_rms(codec, heavy):.4g}"),
        })
    return rows


def run(quick: bool, reporter=None) -> dict:
    cfg = settings(quick)
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine skews every figure
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    codecs = codecs_under_test()
    if reporter is not None:
        reporter.total(len(cfg["shapes"]) * len(cfg["dtypes"]) * len(codecs))
    results = []
    try:
        for shape in cfg["shapes"]:
            for dtype_name in cfg["dtypes"]:
                dtype = getattr(torch, dtype_name)
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(shape, generator=gen).to(dtype)
                heavy = _student_t2(shape, gen).to(dtype)
                results += measure(codecs, x, heavy, cfg["repeats"], reporter)
    finally:
        torch.set_num_threads(threads_before)
    return {
        "name": NAME,
        "config": {"device": "cpu", "threads": 1, "block": qz.BLOCK, "scale_dtype": "float32",
                   "cpu_chunk_values": qz.CPU_CHUNK_VALUES, "load_average_1m_before": load_before,
                   "load_average_1m_after": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(),
                   "timing": "median of repeats of one call, repeats round-robin over codecs, after a warm-up call",
                   "gb_s": "raw tensor bytes / wall seconds; *_cpu_time: / this thread's CPU seconds, "
                           "which leave out time the thread waited for a core on a shared machine", "quick": quick, "torch": torch.__version__,
                   "processor": platform.processor() or platform.machine(), **cfg},
        "results": results,
    }


def table(result: dict) -> str:
    head = (f"{'shape':<14} {'dtype':<9} {'codec':<19} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} "
            f"{'enc+dec GB/s':>12} {'(CPU time)':>10} {'rel RMS err':>11} {'t2 rel RMS':>10}")
    lines = [head, "-" * len(head)]
    for r in result["results"]:
        lines.append(f"{'x'.join(map(str, r['shape'])):<14} {r['dtype']:<9} {r['codec']:<19} "
                     f"{r['compression_ratio']:>6.2f} {r['encode_gb_s']:>9.2f} {r['decode_gb_s']:>9.2f} "
                     f"{r['encode_decode_gb_s']:>12.2f} {r['encode_decode_gb_s_cpu_time']:>10.2f} "
                     f"{r['rel_rms_error_normal']:>11.2e} "
                     f"{r['rel_rms_error_student_t2']:>10.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats (results/quick/)")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(table(result))
    out_dir = RESULTS / "quick" if args.quick else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{NAME}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)  # never a half-written file
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
