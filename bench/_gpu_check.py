"""The GPU path, checked on a machine with CUDA (never in CI): run by bench/gpu_check.sh (named with "_" so that `bench/run.py all` does not take it for a benchmark).

1. codecs: every codec's encode + decode of an activation-sized tensor on the GPU (max error
   against the input, GB/s);
2. profiler: per-layer CUDA timings and the allocator's peak of the tiny preset, fp32 and bf16;
3. training: the local example's shape on CUDA — three agents, on three GPUs with NCCL where
   there are three, else all on one GPU with gloo between them — fp32 and bf16, 60 steps each:
   tokens/s, first and final loss, the data-plane backend the run used;
4. memory: a stage over its node's memory_fraction stops the job with one line.
Prints one table; writes the figures to bench/results/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def codecs() -> list[tuple[str, str, str]]:
    import torch

    from hetlaunch.runtime.codecs import CODECS_BY_NAME

    x = torch.randn(8, 512, 1024, device="cuda")
    rows = []
    for name, codec in CODECS_BY_NAME.items():
        payloads = codec.encode(x)
        y = codec.decode(payloads, tuple(x.shape), x.dtype)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            codec.decode(codec.encode(x), tuple(x.shape), x.dtype)
        torch.cuda.synchronize()
        gbps = 10 * x.numel() * 4 / (time.perf_counter() - start) / 1e9
        ok = y.device.type == "cuda" and y.dtype == x.dtype and y.shape == x.shape
        rows.append((f"codec {name}", f"max err {float((y - x).abs().max()):.3g}, {gbps:.1f} GB/s",
                     "ok" if ok else "WRONG device/dtype/shape"))
    return rows


def profiler() -> list[tuple[str, str, str]]:
    import torch

    from hetlaunch.runtime.model_spec import ModelSpec, preset
    from hetlaunch.runtime.node_measurement import profile_layers

    rows = []
    for precision in ("fp32", "bf16"):
        torch.cuda.reset_peak_memory_stats()
        measured = profile_layers(ModelSpec(gpt=preset("small")), 8, torch.device("cuda"), precision=precision)
        peak = torch.cuda.max_memory_allocated() / 2**20
        ms = ", ".join(f"{m.seconds * 1e3:.2f}" for m in measured)
        rows.append((f"profile small {precision}", f"ms/layer [{ms}], peak {peak:.0f} MiB",
                     "ok" if all(m.seconds > 0 for m in measured) else "WRONG"))
    return rows


def training() -> list[tuple[str, str, str]]:
    import torch

    gpus = torch.cuda.device_count()
    devices = [f"cuda:{i}" for i in range(3)] if gpus >= 3 else ["cuda:0"] * 3
    rows = []
    for precision in ("fp32", "bf16"):
        tmp = Path(tempfile.mkdtemp(prefix="hetlaunch-gpu-"))
        nodes = "\n".join(f"  - {{name: g{i}, device: '{d}', layers: [{2 * i}, {2 * i + 2}]}}"
                          for i, d in enumerate(devices))
        (tmp / "cluster.yaml").write_text(f"name: gpu-{precision}\nmodel: {{preset: tiny}}\n"
                                          f"train: {{steps: 60, precision: {precision}, checkpoint_every: 0}}\n"
                                          f"nodes:\n{nodes}\n")
        proc = subprocess.run([sys.executable, "-m", "hetlaunch.launcher.cli", "up", str(tmp / "cluster.yaml"),
                               "--run-dir", str(tmp / "run")], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            rows.append((f"train {precision}", proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed",
                         "FAILED"))
            continue
        summary = json.loads((tmp / "run" / "summary.json").read_text())
        events = [json.loads(line) for line in (tmp / "run" / "events.jsonl").read_text().splitlines()]
        backend = next((e.get("backend") for e in events if e.get("backend")), "nccl" if gpus >= 3 else "gloo")
        rows.append((f"train {precision} ({len(set(devices))} GPU, {backend})",
                     f"{summary['mean_tokens_per_s']:.0f} tokens/s, loss {summary['first_loss']:.3f} -> "
                     f"{summary['final_loss']:.3f}", "ok" if summary["final_loss"] < summary["first_loss"] else "WRONG"))
    return rows


def memory_limit() -> list[tuple[str, str, str]]:
    """A stage over its node's memory_fraction must stop the job with one line naming it."""
    tmp = Path(tempfile.mkdtemp(prefix="hetlaunch-gpu-"))
    (tmp / "cluster.yaml").write_text("name: gpu-memory\nmodel: {preset: small}\n"
                                      "train: {steps: 5, checkpoint_every: 0}\n"
                                      "nodes:\n  - {name: g0, device: 'cuda:0', layers: [0, 8], memory_fraction: 0.0005}\n")
    proc = subprocess.run([sys.executable, "-m", "hetlaunch.launcher.cli", "up", str(tmp / "cluster.yaml"),
                           "--run-dir", str(tmp / "run")], capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    ok = proc.returncode == 1 and len(errors) == 1 and "memory_fraction" in errors[0]
    return [("memory_fraction 0.0005", errors[0][:120] if errors else f"exit {proc.returncode}", "ok" if ok else "WRONG")]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 2
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows = [("devices", ", ".join(names), "")] + codecs() + profiler() + training() + memory_limit()
    width = max(len(r[0]) for r in rows)
    for name, value, verdict in rows:
        print(f"{name:<{width}}  {verdict:<6}  {value}")
    out = REPO / "bench" / "results" / "gpu_check.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "devices": names,
                               "rows": [list(r) for r in rows]}, indent=2) + "\n")
    os.replace(tmp, out)
    return 0 if all(r[2] in ("", "ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
