"""`hetlaunch up --resume` given what it should refuse: one line, nothing started; exit 2 where the
folder named is not a run (bad input, like a bad YAML), else 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import run_hetlaunch

CLUSTER = """
name: resume
model: {preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}
train: {steps: 3, micro_batch_size: 2, num_microbatches: 2}
nodes: [{name: a, device: cpu, threads: 1}]
"""


def resume(tmp_path, run_dir) -> subprocess.CompletedProcess:
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    return run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run_dir), timeout=60)


def one_error(result: subprocess.CompletedProcess, code: int = 1) -> str:
    assert result.returncode == code, result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not (result.stdout.strip()), result.stdout  # nothing started: no coordinator line
    return lines[0]


@pytest.mark.timeout(90)
def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    assert "not a run directory (no metrics.jsonl)" in one_error(resume(tmp_path, tmp_path / "nowhere"), 2)


@pytest.mark.timeout(90)
def test_metrics_that_are_not_ours_are_refused_naming_the_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 1, "tokens_per_s": 1, "step_s": 1, "stages": []}\n'
                                           "\x00garbage\n{}\n")
    assert "line 2 is not a step record" in one_error(resume(tmp_path, run_dir))


@pytest.mark.timeout(90)
def test_a_run_whose_coordinator_still_runs_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    # A live process whose command line says hetlaunch stands in for the other coordinator.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hetlaunch"])
    try:
        (run_dir / "coordinator.json").write_text(json.dumps({"address": "127.0.0.1:1", "pid": other.pid}))
        assert f"its coordinator (pid {other.pid}) is still running" in one_error(resume(tmp_path, run_dir))
    finally:
        other.kill()
        other.wait()
    assert os.path.getsize(run_dir / "metrics.jsonl") == 0  # untouched
