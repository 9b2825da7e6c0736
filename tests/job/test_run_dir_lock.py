"""One coordinator per run directory: a second `up` on the run dir of a running job refuses in
one line and touches nothing there; once the first is gone (even by SIGKILL) the directory can be
resumed — the lock ends with its process, no stale lock is left."""

from __future__ import annotations

import json
import os
import signal

import pytest

from conftest import popen_hetlaunch, run_hetlaunch, stop_process, wait_for

STEPS = 40
CLUSTER = f"""name: locked
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 2}}
nodes: [{{name: a, device: cpu, threads: 1, layers: [0, 4],
          emulate: {{speed_changes: [{{at_step: 3, speed: 0.01}}, {{at_step: 7, speed: 1.0}}]}}}}]
"""  # steps 3-6 slow (a sleep): `up` is still running when it is stopped, though steps are logged late


def _steps(run_dir) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


@pytest.mark.timeout(240)
def test_a_second_up_on_a_running_jobs_run_dir_refuses_and_changes_nothing(tmp_path):
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    run_dir = tmp_path / "run"
    first = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: len(_steps(run_dir)) >= 3, 120, "3 steps", proc=first)
        os.kill(first.pid, signal.SIGSTOP)  # it holds the directory, whatever its speed
        files = {name: (run_dir / name).read_bytes() for name in ("token", "coordinator.json", "metrics.jsonl")}
        for args in (("--run-dir", str(run_dir)), ("--resume", str(run_dir))):
            second = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), *args, timeout=60)
            lines = [line for line in second.stderr.splitlines() if line.strip()]
            assert second.returncode == 1 and len(lines) == 1, second.stderr + second.stdout
            assert str(run_dir) in lines[0] and ("in use by another hetlaunch up" in lines[0]
                                                 or "is still running" in lines[0]), lines[0]
        assert {name: (run_dir / name).read_bytes() for name in files} == files
        os.kill(first.pid, signal.SIGKILL)  # gone without a word: its lock goes with it
        first.wait(timeout=30)
    finally:
        os.kill(first.pid, signal.SIGCONT) if first.poll() is None else None
        stop_process(first)
    resumed = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(run_dir), timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(run_dir) == list(range(STEPS))


@pytest.mark.timeout(240)
def test_a_second_run_sharing_a_running_jobs_checkpoint_dir_refuses_and_changes_nothing(tmp_path):
    """Two runs with one checkpoint.dir (remote nodes need a shared one: the same YAML started twice)
    passed the check for a fresh directory before either committed, then overwrote, pruned and
    deleted each other's checkpoints (a hostile review). The directory is locked like a run's."""
    shared = tmp_path / "shared"
    (tmp_path / "cluster.yaml").write_text(CLUSTER.replace("nodes:", f"checkpoint: {{dir: {shared}}}\nnodes:"))
    first = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "first"))
    try:
        wait_for(lambda: len(_steps(tmp_path / "first")) >= 3, 120, "3 steps", proc=first)
        os.kill(first.pid, signal.SIGSTOP)
        second = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "second"), timeout=60)
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 1 and lines == [
            f"error: checkpoint.dir {shared} is in use by another hetlaunch up (pid {first.pid}): give this run a "
            "checkpoint directory of its own"], second.stderr + second.stdout
        assert not (tmp_path / "second").exists()  # refused before anything started: nothing left behind
    finally:
        os.kill(first.pid, signal.SIGCONT) if first.poll() is None else None
        stop_process(first)


@pytest.mark.timeout(240)
def test_a_run_cannot_take_a_running_jobs_default_checkpoint_dir_and_one_may_checkpoint_into_its_own_run_dir(tmp_path):
    """The default checkpoint directory (inside the run directory) is locked too; and a checkpoint.dir
    that is the run directory itself is one lock, not two (a review of the lock found the run
    refusing itself, `up` and `up --resume` alike)."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    first = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "first"))
    try:
        wait_for(lambda: len(_steps(tmp_path / "first")) >= 3, 120, "3 steps", proc=first)
        os.kill(first.pid, signal.SIGSTOP)
        taken = CLUSTER.replace("nodes:", f"checkpoint: {{dir: {tmp_path / 'first' / 'checkpoints'}}}\nnodes:")
        (tmp_path / "taken.yaml").write_text(taken)
        second = run_hetlaunch("up", str(tmp_path / "taken.yaml"), "--run-dir", str(tmp_path / "second"), timeout=60)
        assert second.returncode == 1 and "is in use by another hetlaunch up" in second.stderr, second.stderr
    finally:
        os.kill(first.pid, signal.SIGCONT) if first.poll() is None else None
        stop_process(first)
    own = tmp_path / "own"
    short = CLUSTER.replace(f"steps: {STEPS}", "steps: 4")
    (tmp_path / "own.yaml").write_text(short.replace("nodes:", f"checkpoint: {{dir: {own}}}\nnodes:"))
    done = run_hetlaunch("up", str(tmp_path / "own.yaml"), "--run-dir", str(own), timeout=120)
    assert done.returncode == 0, done.stderr
    (tmp_path / "own6.yaml").write_text((tmp_path / "own.yaml").read_text().replace("steps: 4", "steps: 6"))
    resumed = run_hetlaunch("up", str(tmp_path / "own6.yaml"), "--resume", str(own), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(own) == list(range(6))
