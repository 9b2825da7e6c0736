"""`hetlaunch up cluster_examples/tiny_test.yaml` as a user runs it: it trains, learns, and records the run;
checkpoints are written as the README says (`train.checkpoint_every`: every k steps and after the last; 0: never)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_hetlaunch
from hetlaunch.runtime.checkpoint_manifest import MANIFEST_NAME, checkpoint_dir

EXAMPLE = REPO / "cluster_examples" / "tiny_test.yaml"


@pytest.mark.timeout(180)
def test_tiny_example_trains_and_writes_the_run_dir(tmp_path):
    steps = yaml.safe_load(EXAMPLE.read_text())["train"]["steps"]
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(EXAMPLE), "--run-dir", str(run_dir), timeout=150, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert not (tmp_path / "runs").exists(), "--run-dir must be the only place the run is written"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        assert {"step", "loss", "tokens_per_s", "stages"} <= r.keys()
        assert r["loss"] > 0 and r["tokens_per_s"] > 0
        assert r["stages"], "a step with no stages"
        for stage in r["stages"]:
            assert stage["compute_s"] >= 0 and stage["comm_s"] >= 0, stage

    summary = json.loads((run_dir / "summary.json").read_text())
    assert {"plan", "final_loss", "mean_tokens_per_s", "wall_s"} <= summary.keys()
    assert summary["final_loss"] == records[-1]["loss"]
    assert summary["mean_tokens_per_s"] > 0 and summary["wall_s"] > 0
    plan_nodes = [s["node"] for s in summary["plan"]["stages"]]
    assert plan_nodes and set(plan_nodes) <= {"n0", "n1", "n2"}
    assert all([s["node"] for s in r["stages"]] == plan_nodes for r in records)
    assert not list(run_dir.glob("*.tmp")), "half-written files left in the run directory"
    # Agents' logs are this user's alone (what a remote terminal may echo lands there).
    logs = run_dir / "logs"
    assert logs.stat().st_mode & 0o777 == 0o700 and (logs / "n0.log").stat().st_mode & 0o777 == 0o600
    # checkpoint_every is 50 by default, more than the run's steps: one checkpoint, after the last step
    saved = sorted(p.parent.name for p in (run_dir / "checkpoints").glob(f"*/{MANIFEST_NAME}"))
    assert saved == [checkpoint_dir(Path(), steps).name], saved

    # It learns: byte-level loss starts near ln(256) = 5.5 and drops well below it within the run.
    first, last3 = records[0]["loss"], sum(r["loss"] for r in records[-3:]) / 3
    assert last3 < first - 0.5, [round(r["loss"], 3) for r in records]


@pytest.mark.timeout(180)
def test_checkpoint_every_0_writes_no_checkpoint_not_even_after_the_last_step(tmp_path):
    cluster = yaml.safe_load(EXAMPLE.read_text())
    cluster["train"].update(steps=4, checkpoint_every=0)
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=150, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 4
    assert not list(run_dir.rglob(MANIFEST_NAME)) and not list(run_dir.rglob("*.safetensors")), \
        sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "checkpoint"], events
