"""What losing a node costs: detection, recovery, steps redone, throughput before and after.

Each run is `hetlaunch up` on the local example's four nodes (two regions, one node at half
speed, a 200 Mbps link between the regions) pinned to two pipelines, with the defaults users
get (`compression: auto`, `checkpoint_every: 50`, heartbeats every 0.5 s, lost after 4 s).
At a random step (seeded) the benchmark SIGKILLs a whole agent, or only its worker, or freezes
the worker with SIGSTOP (a hung collective or data loader looks like that: only the progress
watchdog finds it, at the default train.watchdog_s), taking turns, and reads from events.jsonl
and metrics.jsonl:

  detection_s    kill -> the coordinator declared the node lost
  recovery_s     kill -> the first step of the next generation completed
  recovery_after_detection_s   declared lost -> that first step
  lost_steps     logged steps redone (0 when a live replica stood in for the lost layers)
  tokens_per_s_before / _after   mean throughput before the kill and after the restore
  restore_source "replica" (the survivors' snapshots) or "file" (the last checkpoint)

Checkpoint overhead: the same cluster without a loss, with checkpoints at the default
interval and without any (`checkpoint_every: 0`), alternated A, B, A, B; the ratio of their
tokens/s over the whole run (a mean over wall time, so a stall at a checkpoint counts).
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _harness import REPO, BenchError, NullReporter, Reporter, start_process, stop_process

DETECTION_TARGET_S = 5.0  # a killed agent or worker
RECOVERY_TARGET_S = 30.0
WATCHDOG_BOUND_S = 60.0  # train.watchdog_s auto on this tiny model: its 60 s floor (launcher/stage_launch.py)
FROZEN_DETECTION_TARGET_S = 2 * WATCHDOG_BOUND_S  # a frozen worker: within twice the watchdog's bound
AFTER_DETECTION_TARGET_S = 10.0
HURTS = ("agent", "worker", "frozen")
OVERHEAD_TARGET = 0.97
NODES = [("east-a", "us-east", 1.0, 0, 3, 0), ("west-a", "eu-west", 1.0, 3, 6, 0),
         ("east-b", "us-east", 0.5, 0, 3, 1), ("west-b", "eu-west", 1.0, 3, 6, 1)]


def settings(quick: bool) -> dict:
    return ({"runs": 3, "steps": 60, "overhead_reps": 1, "overhead_steps": 60} if quick
            else {"runs": 6, "steps": 160, "overhead_reps": 3, "overhead_steps": 120})


def cluster_yaml(steps: int, checkpoint_every: int | None = None) -> str:
    nodes = "\n".join(f"  - {{name: {n}, region: {r}, device: cpu, threads: 1, layers: [{a}, {b}], pipeline: {p}"
                      + (f", emulate: {{speed: {s}}}" if s != 1.0 else "") + "}"
                      for n, r, s, a, b, p in NODES)
    every = f"\n  checkpoint_every: {checkpoint_every}" if checkpoint_every is not None else ""
    return f"""name: bench-recovery
model: {{preset: tiny}}
train:
  steps: {steps}
  micro_batch_size: 8
  num_microbatches: 4{every}
links:
  - between: [us-east, eu-west]
    emulate: {{bandwidth_mbps: 200, latency_ms: 5}}
nodes:
{nodes}
"""


def _records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _agent(node: str) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "hetlaunch.runtime.agent" in cmdline and f"--name={node}" in cmdline:
            return proc
    raise BenchError(f"no agent process for {node}")


def _mean_tokens_per_s(records: list[dict]) -> float | None:
    """Tokens over wall time between the first and the last of these step records."""
    if len(records) < 2:
        return None
    seconds = records[-1]["time"] - records[0]["time"]
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in records[1:])
    return tokens / seconds if seconds > 0 else None


def one_loss(steps: int, kill_step: int, node: str, what: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="hetlaunch-bench-") as tmp:
        yaml_path, run_dir = Path(tmp) / "cluster.yaml", Path(tmp) / "run"
        yaml_path.write_text(cluster_yaml(steps))
        proc = start_process([sys.executable, "-m", "hetlaunch.launcher.cli", "up", str(yaml_path),
                              "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + timeout_s
            while len(_records(run_dir, "metrics.jsonl")) < kill_step:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError(f"the run ended or stalled before step {kill_step}: {proc.stderr.read()[-500:]}")
                time.sleep(0.02)
            agent = _agent(node)
            target = agent if what == "agent" else next(
                c for c in agent.children() if "hetlaunch.runtime.worker" in " ".join(c.cmdline()))
            killed_at = time.time()
            target.send_signal(signal.SIGSTOP if what == "frozen" else signal.SIGKILL)
            _, stderr = proc.communicate(timeout=max(10.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise BenchError(f"the run failed after the kill: {stderr.strip().splitlines()[-1:]}")
        except subprocess.TimeoutExpired:
            raise BenchError(f"the run did not finish within {timeout_s:.0f}s after the kill") from None
        finally:
            stop_process(proc)
            if what == "frozen" and target.is_running():
                target.send_signal(signal.SIGCONT)  # never leave a stopped process behind
        events = _records(run_dir, "events.jsonl")
        metrics = _records(run_dir, "metrics.jsonl")
    lost = next(e for e in events if e["event"] == "lost")
    restart = next(e for e in events if e["event"] == "restart")
    restore = next(e for e in events if e["event"] == "restore")
    resumed = next(e for e in events if e["event"] == "first_step" and e["time"] > restart["time"])
    before = [r for r in metrics if r["time"] < killed_at]
    after = [r for r in metrics if r["step"] >= restore["step"] + 2]
    return {"killed": what, "node": node, "kill_step": kill_step, "detection_s": lost["time"] - killed_at,
            "recovery_s": resumed["time"] - killed_at, "recovery_after_detection_s": resumed["time"] - lost["time"],
            "why": lost["why"], "lost_steps": restart["lost_steps"],
            "restore_source": restore["source"], "restore_step": restore["step"],
            "tokens_per_s_before": _mean_tokens_per_s(before), "tokens_per_s_after": _mean_tokens_per_s(after),
            "steps_logged": len(metrics), "steps_unique": len({r["step"] for r in metrics})}


def one_plain(steps: int, checkpoint_every: int | None, timeout_s: float) -> float:
    with tempfile.TemporaryDirectory(prefix="hetlaunch-bench-") as tmp:
        yaml_path, run_dir = Path(tmp) / "cluster.yaml", Path(tmp) / "run"
        yaml_path.write_text(cluster_yaml(steps, checkpoint_every))
        result = subprocess.run([sys.executable, "-m", "hetlaunch.launcher.cli", "up", str(yaml_path), "--run-dir",
                                 str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise BenchError(f"hetlaunch up failed: {result.stderr.strip().splitlines()[-1:]}")
        return _mean_tokens_per_s(_records(run_dir, "metrics.jsonl")[3:])


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "max": max(values)} if values else {}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    cfg = settings(quick)
    rng = random.Random(0)
    reporter.total(cfg["runs"] + 2 * cfg["overhead_reps"])
    losses = []
    for i in range(cfg["runs"]):
        node = rng.choice([n[0] for n in NODES])
        what = HURTS[i % len(HURTS)]
        kill_step = rng.randint(cfg["steps"] // 6, cfg["steps"] // 2)
        how = "SIGSTOP the worker" if what == "frozen" else f"SIGKILL the {what}"
        reporter.advance(f"run {i + 1}/{cfg['runs']}: {how} of {node} at step {kill_step}")
        losses.append(one_loss(cfg["steps"], kill_step, node, what, timeout_s=300 + 2 * WATCHDOG_BOUND_S))
    with_ckpt, without = [], []
    for rep in range(cfg["overhead_reps"]):
        reporter.advance(f"checkpoints at the default interval ({rep + 1}/{cfg['overhead_reps']})")
        with_ckpt.append(one_plain(cfg["overhead_steps"], None, timeout_s=300))
        reporter.advance(f"no checkpoints ({rep + 1}/{cfg['overhead_reps']})")
        without.append(one_plain(cfg["overhead_steps"], 0, timeout_s=300))
    reporter.advance("done")
    killed = [r for r in losses if r["killed"] != "frozen"]
    frozen = [r for r in losses if r["killed"] == "frozen"]
    detection = _summary([r["detection_s"] for r in killed])
    recovery = _summary([r["recovery_s"] for r in killed])
    by_hurt = {what: {"detection_s": _summary([r["detection_s"] for r in losses if r["killed"] == what]),
                      "recovery_after_detection_s": _summary([r["recovery_after_detection_s"] for r in losses
                                                              if r["killed"] == what]),
                      "lost_steps": _summary([r["lost_steps"] for r in losses if r["killed"] == what])}
               for what in HURTS}
    overhead = statistics.median(with_ckpt) / statistics.median(without)
    replica_runs = [r for r in losses if r["restore_source"] == "replica"]
    met = (detection["max"] <= DETECTION_TARGET_S and recovery["max"] <= RECOVERY_TARGET_S
           and all(r["detection_s"] <= FROZEN_DETECTION_TARGET_S and "frozen" in r["why"] for r in frozen)
           and all(r["recovery_after_detection_s"] <= AFTER_DETECTION_TARGET_S for r in losses)
           and all(r["lost_steps"] == 0 for r in replica_runs)
           and all(r["lost_steps"] <= 50 for r in losses) and overhead >= OVERHEAD_TARGET)
    return {
        "config": {**cfg, "cluster": cluster_yaml(cfg["steps"])},
        "figure": {"name": "recovery_s (max)", "value": recovery["max"], "target": f"<= {RECOVERY_TARGET_S}"},
        "met": met,
        "detection_s": detection, "recovery_s": recovery, "by_hurt": by_hurt,
        "targets": {"detection_s": DETECTION_TARGET_S, "frozen_detection_s": FROZEN_DETECTION_TARGET_S,
                    "recovery_s": RECOVERY_TARGET_S, "recovery_after_detection_s": AFTER_DETECTION_TARGET_S},
        "lost_steps": _summary([r["lost_steps"] for r in losses]),
        "tokens_per_s_before": _summary([r["tokens_per_s_before"] for r in losses if r["tokens_per_s_before"]]),
        "tokens_per_s_after": _summary([r["tokens_per_s_after"] for r in losses if r["tokens_per_s_after"]]),
        "restore_source": [r["restore_source"] for r in losses],
        "checkpoint_overhead": {"tokens_per_s_with": with_ckpt, "tokens_per_s_without": without, "ratio": overhead,
                                "target": OVERHEAD_TARGET},
        "runs": losses,
    }
