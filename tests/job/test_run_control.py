"""See and stop a running job from its run directory: `hetlaunch status`, `logs`, `down` — real
RPCs on the job's control plane with the token the run dir holds — and `up --resume` after a
`down` continues from the checkpoint it stopped at."""

from __future__ import annotations

import json
import re

import pytest

from conftest import popen_hetlaunch, run_hetlaunch, stop_process, wait_for

STEPS = 400
SLOW = "{speed_changes: [{at_step: 5, speed: 0.01}, {at_step: 20, speed: 1.0}]}"


def steps_done(run_dir) -> int:
    try:
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.timeout(240)
def test_status_logs_and_down_of_a_running_job(tmp_path):
    yaml = tmp_path / "cluster.yaml"
    yaml.write_text(f"""name: control
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 20, rebalance: off}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2], emulate: {SLOW}}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4], emulate: {SLOW}}}
""")  # pinned: both nodes train whatever the machine's load makes the planner think
    # From step 5 to 19 at 1/100 of the speed (a sleep): status, logs and down (three CLI starts on a
    # loaded machine) come while the job runs; the steps were ~10 ms and a step is logged late.
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: steps_done(run_dir) >= 5, 120, "5 steps", proc=up, interval=0.1)
        status = run_hetlaunch("status", str(run_dir), timeout=30)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert re.search(r": generation \d+$", lines[0]), lines[0]
        nodes = {line.split()[0]: line.split()[1] for line in lines[2:]}
        assert nodes == {"a": "training", "b": "training"}, status.stdout
        logs = run_hetlaunch("logs", str(run_dir), "a", timeout=30)
        assert logs.returncode == 0 and "[agent a] registered with" in logs.stdout
        stopped = run_hetlaunch("down", str(run_dir), "--reason", "maintenance", timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        up.wait(timeout=90)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, err
    assert "stopped by `hetlaunch down` at the checkpoint of step" in out + err
    done = steps_done(run_dir)
    assert 20 <= done < STEPS
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    downs = [e for e in events if e["event"] == "down"]
    assert downs and downs[0]["why"] == "maintenance" and downs[0]["step"] % 20 == 0
    said = "".join((out + err).split())  # the console wraps a long line: compare without whitespace
    # where, said as a command that runs (it lacked the YAML; a review)
    assert "".join(f"`hetlaunch up {yaml} --resume {run_dir}` continues from step {downs[0]['step']}".split()) in said
    assert "".join(f"at the checkpoint of step {downs[0]['step']}: maintenance;".split()) in said
    # The run has ended: status says so in one line; a bad node name for logs too.
    ended = run_hetlaunch("status", str(run_dir), timeout=30)
    assert ended.returncode == 1 and "is not running" in ended.stderr
    assert run_hetlaunch("logs", str(run_dir), "zz", timeout=30).returncode == 2
    # And the job continues where it stopped.
    resumed = run_hetlaunch("up", str(yaml), "--resume", str(run_dir), timeout=200)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
