"""Runs of `hetlaunch up` that a test hurts at a step: the processes to hurt and the run's files
(tests/state/test_recovery.py, tests/state/test_island_recovery.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from conftest import agent_of, popen_hetlaunch, stop_process, wait_for


def steps_done(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def agent_process(node: str) -> psutil.Process:
    proc = agent_of(node)
    if proc is None:
        raise AssertionError(f"no agent process for {node}")
    return proc


def worker_of(node: str) -> psutil.Process:
    """The worker running the node's stage (the same process ran its profiling before)."""
    workers = [c for c in agent_process(node).children() if "hetlaunch.runtime.worker" in " ".join(c.cmdline())]
    assert len(workers) == 1, workers
    return workers[0]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_and_hurt(tmp_path: Path, yaml_text: str, hurt, at_step: int, timeout: float = 150):
    """Start `up`, call hurt() once `at_step` steps are logged; return (run_dir, rc, output, hurt time)."""
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(yaml_text)
    run_dir = tmp_path / "run"
    proc = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: steps_done(run_dir) >= at_step, 90, f"step {at_step}", proc, interval=0.02)
        hurt_at = time.time()
        hurt()
        proc.wait(timeout=timeout)
    finally:
        stdout, stderr = stop_process(proc)
    return run_dir, proc.returncode, stderr + stdout, hurt_at
