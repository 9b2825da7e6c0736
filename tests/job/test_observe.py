"""Metrics where users look: TensorBoard scalars, a Prometheus endpoint on the coordinator, and
`hetlaunch report` pictures — each an optional extra with a one-line error when it is missing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest
import yaml

from conftest import REPO, hetlaunch_cmd, hetlaunch_env, run_hetlaunch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster(tmp_path, **extra) -> str:
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    cluster["train"].update(steps=60, checkpoint_every=0)
    for key, value in extra.items():
        section, field = key.split("__")
        cluster.setdefault(section, {})[field] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster))
    return str(path)


def _scrape(port: int) -> dict[str, float]:
    """name{labels} -> value of every sample the endpoint serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.mark.timeout(300)
def test_up_serves_prometheus_writes_tensorboard_and_report_draws_the_run(tmp_path):
    """The job runs until the test has scraped it and says `hetlaunch down` (it once ran 60 steps,
    and on a fast machine they were over before the endpoint was scraped at step 5)."""
    port = _free_port()
    path = _cluster(tmp_path, coordinator__metrics_port=port, observe__tensorboard=True, train__steps=100_000)
    run_dir = tmp_path / "run"
    up = subprocess.Popen(hetlaunch_cmd("up", path, "--run-dir", str(run_dir)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=hetlaunch_env(), cwd=tmp_path)
    try:
        samples, deadline = {}, time.monotonic() + 200
        while samples.get("hetlaunch_step", -1) < 5:
            assert up.poll() is None, up.communicate()
            assert time.monotonic() < deadline, "no step reached the metrics endpoint"
            try:
                samples = _scrape(port)
            except OSError:
                pass
            time.sleep(0.3)
        assert samples["hetlaunch_tokens_per_second"] > 0 and 0 < samples["hetlaunch_loss"] < 10
        assert samples["hetlaunch_generation"] >= 1 and samples["hetlaunch_restarts"] == 0
        ages = {k: v for k, v in samples.items() if k.startswith("hetlaunch_heartbeat_age_seconds")}
        assert {k.split('"')[1] for k in ages} == {"n0", "n1", "n2"} and all(0 <= v < 5 for v in ages.values()), ages
        assert any(k.startswith("hetlaunch_node_step_seconds") for k in samples)
        stopped = run_hetlaunch("down", str(run_dir), timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        out, err = up.communicate(timeout=200)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0, err + out
    assert f"metrics at http://127.0.0.1:{port}/metrics" in out
    with socket.socket() as s:  # the endpoint went away with the run
        assert s.connect_ex(("127.0.0.1", port)) != 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run_dir / "tensorboard"))
    board.Reload()
    tags = board.Tags()["scalars"]
    losses = board.Scalars("loss/train")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 6 <= len(records) < 100_000
    assert [e.step for e in losses] == [r["step"] for r in records] == list(range(len(records)))
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert {"throughput/tokens_per_s", "run/generation"} <= set(tags)
    assert any(t.startswith("stage_compute_fraction/") for t in tags)

    drawn = run_hetlaunch("report", str(run_dir), timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    for name in ("training.png", "plan.png", "stages.png"):
        png = (run_dir / "report" / name).read_bytes()
        assert png.startswith(PNG_SIGNATURE) and len(png) > 5000, name
        assert name in drawn.stdout


def test_a_missing_extra_is_one_line_before_anything_starts(tmp_path):
    stubs = tmp_path / "stubs"
    for package in ("tensorboard", "prometheus_client", "matplotlib"):
        (stubs / package).mkdir(parents=True)
        (stubs / package / "__init__.py").write_text("raise ImportError('not installed (test stub)')\n")
    env = {**hetlaunch_env(), "PYTHONPATH": os.pathsep.join([str(stubs), hetlaunch_env().get("PYTHONPATH", "")])}
    for extra, setting, words in ((dict(observe__tensorboard=True), "observe.tensorboard", "hetlaunch[tensorboard]"),
                                  (dict(coordinator__metrics_port=9), "coordinator.metrics_port",
                                   "hetlaunch[prometheus]")):
        path = _cluster(tmp_path, **extra)
        for command in ("validate", "up"):
            result = subprocess.run(hetlaunch_cmd(command, path), capture_output=True, text=True, env=env,
                                    timeout=60, cwd=tmp_path)
            assert result.returncode == 2, (command, result.stdout, result.stderr)
            assert setting in result.stderr and words in result.stderr and len(result.stderr.strip().splitlines()) == 1
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 0}\n')
    drawn = subprocess.run(hetlaunch_cmd("report", str(tmp_path / "run")), capture_output=True, text=True, env=env,
                           timeout=60)
    assert drawn.returncode == 2 and "hetlaunch[plots]" in drawn.stderr


def test_report_refuses_what_is_not_a_run(tmp_path):
    assert run_hetlaunch("report", str(tmp_path / "nowhere"), timeout=60).stderr.count("\n") == 1
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    missing = run_hetlaunch("report", str(run_dir), timeout=60)
    assert missing.returncode == 2 and "metrics.jsonl: no such file" in missing.stderr
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\nnot json\n{"step": 2}\n')
    broken = run_hetlaunch("report", str(run_dir), timeout=60)
    assert broken.returncode == 2 and "line 2 is not JSON" in broken.stderr
    (run_dir / "metrics.jsonl").write_text('[1, 2]\n{"step": 1}\n')
    alien = run_hetlaunch("report", str(run_dir), timeout=60)
    assert alien.returncode == 2 and "line 1 is not a JSON object" in alien.stderr
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 1}\n')
    partial = run_hetlaunch("report", str(run_dir), timeout=60)
    assert partial.returncode == 2 and "not a hetlaunch metrics file" in partial.stderr


def _a_run(run_dir):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 2.0 - s / 10, "tokens_per_s": 100.0, "stages": [], "time": 1000.0 + s}) + "\n"
        for s in range(4)))
    return run_dir


@pytest.mark.timeout(200)
def test_report_on_hostile_run_files_is_one_line(tmp_path):
    """A FIFO metrics.jsonl hung; a line nested thousands deep, an event at the time "soon", a
    summary whose plan is a list, a directory in a PNG's place: tracebacks; a plan of
    20,000 stages took minutes and 1.3 GB."""
    def refused(run_dir, words):
        result = run_hetlaunch("report", str(run_dir), timeout=60)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and words in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "metrics.jsonl")
    refused(fifo, "metrics.jsonl: not a regular file")
    deep = _a_run(tmp_path / "deep")
    (deep / "events.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n{}\n")
    refused(deep, "events.jsonl: line 1 is not JSON")
    soon = _a_run(tmp_path / "soon")
    (soon / "events.jsonl").write_text(json.dumps({"event": "restart", "time": "soon"}) + "\n")
    assert run_hetlaunch("report", str(soon), timeout=60).returncode == 0  # nowhere to mark it: not marked
    listed = _a_run(tmp_path / "listed")
    (listed / "summary.json").write_text(json.dumps({"plan": [1, 2]}))
    refused(listed, "summary.json: its plan is not one hetlaunch wrote")
    null = _a_run(tmp_path / "null")
    (null / "summary.json").write_text("null")  # JSON, but not a summary: it was called "not JSON" (a hostile review)
    refused(null, "summary.json: not a summary hetlaunch wrote (a JSON object)")
    taken = _a_run(tmp_path / "taken")
    (taken / "report" / "training.png").mkdir(parents=True)  # the PNG's place taken (its temp name is its own now)
    refused(taken, "cannot write")
    huge = _a_run(tmp_path / "huge")
    stage = {"node": "n", "region": "r", "pipeline": 0, "layer_start": 0, "layer_end": 1, "forward_codec": "none"}
    (huge / "summary.json").write_text(json.dumps({"plan": {"stages": [stage] * 20_000, "num_layers": 1}}))
    refused(huge, "its plan has 20,000 stages, more than the 1,024 plan.png draws (training.png is written)")
    assert (huge / "report" / "training.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.timeout(120)
def test_a_metrics_port_in_use_is_refused_before_any_agent_starts(tmp_path):
    """It was found only when the server started, after every agent had profiled."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = _cluster(tmp_path, coordinator__metrics_port=port)
        result = run_hetlaunch("up", path, "--run-dir", str(tmp_path / "run"), timeout=90, cwd=tmp_path)
    assert result.returncode == 1, result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1] == (f"error: coordinator.metrics_port {port}: cannot listen on "
                                                      "127.0.0.1: Address already in use")
    assert "agent" not in result.stdout and "profil" not in result.stdout, result.stdout  # nothing started
    assert not (tmp_path / "run").exists()
