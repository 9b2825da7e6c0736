"""Emulated clusters shared by the planner benchmarks, and `hetlaunch` runs on them.

Four agents share 2 cores here, so every emulated speed is multiplied by BASE_SPEED: a
"speed 1" node computes for BASE_SPEED of its time and sleeps the rest. The agents then
seldom contend for a core, and the speed *ratios* — all the planner can see and all these
benchmarks compare — stay what the cluster describes. (At 0.5 four busy agents contended
enough to make stages 25-50% slower than profiled; at 0.25 the cost model's error on the
same cluster dropped from about 40% to under 10%.)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from _harness import BenchError, run_process, temporary_dir

BASE_SPEED = 0.25
MODEL = "{preset: tiny, n_layers: 10, seq_len: 64, d_model: 64}"  # 12 stage layers
NUM_LAYERS = 12


def node(name: str, speed: float, region: str = "r0", layers: tuple[int, int] | None = None,
         memory_gb: float | None = None, base_speed: float = BASE_SPEED) -> str:
    emulate = f"speed: {speed * base_speed:g}" + (f", memory_gb: {memory_gb:g}" if memory_gb else "")
    pinned = f", layers: [{layers[0]}, {layers[1]}]" if layers else ""
    return f"  - {{name: {name}, region: {region}, device: cpu, threads: 1, emulate: {{{emulate}}}{pinned}}}\n"


def cluster(name: str, nodes: str, steps: int, microbatches: int = 8, links: str = "", train: str = "") -> str:
    """`train` adds keys to the train section (e.g. "max_pipelines: 1")."""
    return (f"name: {name}\nmodel: {MODEL}\n"
            f"train: {{steps: {steps}, micro_batch_size: 8, num_microbatches: {microbatches}, schedule: 1f1b"
            f"{', ' + train if train else ''}}}\n"
            f"{links}nodes:\n{nodes}")


def run_cli(command: str, cluster_yaml: str, extra: list[str], timeout_s: float, cache_dir: Path) -> Path:
    """`hetlaunch COMMAND cluster.yaml EXTRA...` in a subprocess; returns its temporary folder."""
    tmp = temporary_dir("hetlaunch-bench-")  # read by the caller right after the run
    (tmp / "cluster.yaml").write_text(cluster_yaml)
    os.environ["HETLAUNCH_CACHE_DIR"] = str(cache_dir)  # inherited: every run of a benchmark shares profiles
    extra = [arg.replace("{tmp}", str(tmp)) for arg in extra]
    run_process([sys.executable, "-m", "hetlaunch.launcher.cli", command, str(tmp / "cluster.yaml"), *extra],
                f"hetlaunch {command}", timeout_s)
    return tmp


def profile(cluster_yaml: str, cache_dir: Path) -> dict:
    tmp = run_cli("profile", cluster_yaml, ["-o", "{tmp}/profile.json", "--run-dir", "{tmp}/run"], 300, cache_dir)
    return json.loads((tmp / "profile.json").read_text())


def up(cluster_yaml: str, steps: int, warmup: int, cache_dir: Path) -> dict:
    """One `hetlaunch up`: the median steady step time measured, and the plan with its prediction."""
    tmp = run_cli("up", cluster_yaml, ["--run-dir", "{tmp}/run"], 300 + 10 * steps, cache_dir)
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    if len(records) <= warmup:
        raise BenchError(f"only {len(records)} steps recorded")
    step_s = [r["step_s"] for r in records]
    return {"step_s": step_s, "measured_step_s": statistics.median(step_s[warmup:]),
            "predicted_step_s": summary["plan"].get("predicted_step_s"),
            "stages": [[s["pipeline"], s["node"], s["layer_start"], s["layer_end"]] for s in summary["plan"]["stages"]],
            "pipeline_microbatches": summary["plan"].get("pipeline_microbatches"),
            "sync": summary["plan"].get("sync"), "gradient_sync": summary.get("gradient_sync"),
            "excluded": summary["plan"].get("excluded"), "final_loss": summary.get("final_loss"),
            "contention_note": summary["plan"].get("contention_note"),  # the sharing of cores priced
            "calibration": summary.get("calibration")}
