"""The GPU path, checked on a machine with CUDA (never in CI): run by bench/gpu_check.sh (named with "_" so that `bench/run.py all` does not take it for a benchmark).

1. codecs: every codec's encode + decode of an activation-sized tensor on the GPU (max error
   against the input, GB/s);
2. profiler: per-layer CUDA timings and the allocator's peak of the tiny preset, fp32 and bf16;
3. training: the local example's shape on CUDA — three agents, on three GPUs with NCCL where
   there are three, else all on one GPU with gloo between them — fp32 and bf16, 60 steps each:
   tokens/s, first and final loss, the data-plane backend the run used;
4. memory: a stage over its node's memory_fraction stops the job with one line.
Prints one table; writes the figures to bench/results/gpu_check.json. `--cpu` runs only the
training jobs, on this machine's CPU, to check them before a GPU is spent on them.
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


def _up(name: str, cluster_yaml: str) -> tuple[int, str, dict, list[dict], list[dict]]:
    """One `hetlaunch up` of a cluster YAML: exit code, stderr's last line, summary, events, metrics."""
    tmp = Path(tempfile.mkdtemp(prefix=f"hetlaunch-gpu-{name}-"))
    (tmp / "cluster.yaml").write_text(cluster_yaml)
    proc = subprocess.run([sys.executable, "-m", "hetlaunch.launcher.cli", "up", str(tmp / "cluster.yaml"),
                           "--run-dir", str(tmp / "run")], capture_output=True, text=True, timeout=600)
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    if proc.returncode != 0:
        return proc.returncode, last, {}, [], []
    run = tmp / "run"
    summary = json.loads((run / "summary.json").read_text())
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return 0, last, summary, events, metrics


def _nodes(devices: list[str], layers: bool = True, regions: list[str] | None = None) -> str:
    rows = []
    for i, device in enumerate(devices):
        fields = [f"name: g{i}", f"device: '{device}'"]
        if layers:
            fields.append(f"layers: [{2 * i}, {2 * i + 2}]")
        if regions:
            fields.append(f"region: {regions[i]}")
        rows.append("  - {" + ", ".join(fields) + "}")
    return "nodes:\n" + "\n".join(rows) + "\n"


def _cases(device_list: list[str]) -> list[tuple[str, str]]:
    """The jobs trained on the GPU: the local example's shape in fp32 and bf16, and this round's
    paths that move tensors between devices differently: a V-shaped schedule (two stages per
    node), islands with outer steps, and a sealed data plane."""
    head = "model: {preset: tiny}\n"
    return [
        ("fp32 1f1b", head + "train: {steps: 60, checkpoint_every: 0}\n" + _nodes(device_list)),
        ("bf16 1f1b", head + "train: {steps: 60, precision: bf16, checkpoint_every: 0}\n" + _nodes(device_list)),
        ("fp32 zb-v", head + "train: {steps: 60, schedule: zb-v, checkpoint_every: 0}\n"
         + _nodes(device_list[:2], layers=False)),
        ("fp32 zb-v 2 pipelines", head + "train: {steps: 60, schedule: zb-v, max_pipelines: 2, checkpoint_every: 0}\n"
         + _nodes((device_list * 2)[:4], layers=False)),
        ("fp32 islands", head + "train: {steps: 60, checkpoint_every: 0, outer: {islands: by_region, every: 5}}\n"
         + _nodes(device_list, layers=False, regions=["r0", "r0", "r1"])),
        ("fp32 sealed", head + "data_plane: {encrypt: all}\ntrain: {steps: 60, checkpoint_every: 0}\n"
         + _nodes(device_list)),
    ]


def training(device: str = "cuda") -> list[tuple[str, str, str]]:
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    devices = [f"cuda:{i}" for i in range(3)] if gpus >= 3 else [f"{device}:0" if device == "cuda" else device] * 3
    rows = []
    losses_by_case = {}
    only = os.environ.get("GPU_CHECK_ONLY", "")  # a label's start: run that job alone (a re-check)
    for label, cluster in _cases(devices):
        if not label.startswith(only):
            continue
        rc, last, summary, events, metrics = _up(label.replace(" ", "-"), f"name: gpu-check\n{cluster}")
        if rc != 0:
            rows.append((f"train {label}", last[:160], "FAILED"))
            continue
        losses_by_case[label] = [m["loss"] for m in metrics]
        backend = next((e.get("backend") for e in events if e.get("backend")), "nccl" if gpus >= 3 else "gloo")
        plan = summary["plan"]
        pipelines = len({stage["pipeline"] for stage in plan["stages"]})
        rows.append((f"train {label} ({len(set(devices))} {device}, {backend})",
                     f"{summary['mean_tokens_per_s']:.0f} tokens/s, loss {summary['first_loss']:.3f} -> "
                     f"{summary['final_loss']:.3f}, {plan.get('schedule')} x {pipelines} pipeline(s)",
                     "ok" if summary["final_loss"] < summary["first_loss"] else "WRONG"))
    if device == "cuda" and "fp32 1f1b" in losses_by_case:
        # The same job on the CPU: fp32 on CUDA (no TF32 by default) must do the same arithmetic.
        cpu_yaml = "name: gpu-check\n" + _cases(["cpu"] * 3)[0][1].replace("steps: 60", "steps: 20")
        rc, last, _, _, metrics = _up("fp32-cpu", cpu_yaml)
        if rc != 0:
            rows.append(("fp32 cuda vs cpu", last[:160], "FAILED"))
        else:
            cuda_losses, cpu_losses = losses_by_case["fp32 1f1b"][:20], [m["loss"] for m in metrics]
            worst = max(abs(a - b) / abs(b) for a, b in zip(cuda_losses, cpu_losses))
            rows.append(("fp32 cuda vs cpu, 20 steps", f"worst relative loss difference {worst:.2e}",
                         "ok" if worst <= 1e-3 and len(cpu_losses) == 20 else "WRONG"))
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

    if "--cpu" in sys.argv[1:]:
        # A dry run of the training jobs on this machine's CPU: checks the YAMLs and the paths
        # before device time is spent on them. Writes no JSON.
        rows = training("cpu")
        for name, value, verdict in rows:
            print(f"{name}  {verdict}  {value}", flush=True)
        return 0 if all(r[2] == "ok" for r in rows) else 1
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 2
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    rows = [("devices", ", ".join(names), "")]
    for part in (codecs, profiler, training, memory_limit):
        try:
            found = part()
        except Exception as error:  # one broken part must not hide the others' rows
            found = [(part.__name__, f"{type(error).__name__}: {error}"[:160], "FAILED")]
        for row in found:
            print(f"{row[0]}  {row[2]}  {row[1]}", flush=True)
        rows += found
    width = max(len(r[0]) for r in rows)
    print()
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
