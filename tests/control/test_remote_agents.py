"""Jobs run the way a user runs them: remote agents started by hand with a token file, and a user-defined model."""

from __future__ import annotations

import json
import subprocess

import pytest

from hetlaunch.runtime.model_spec import ModelSpec
from hetlaunch.runtime.wire import model_spec_from_proto, model_spec_to_proto

from conftest import hetlaunch_cmd, hetlaunch_env, popen_hetlaunch, run_hetlaunch, stop_process, wait_for

STEPS = 4


@pytest.mark.timeout(150)
def test_three_remote_agents_with_a_token_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-join-token\n")
    token_file.chmod(0o600)
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""
name: remote-test
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
coordinator: {{host: 127.0.0.1, join_timeout_s: 60}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 2}}
nodes:
  - {{name: r0, launch: remote, host: box-0, device: cpu}}
  - {{name: r1, launch: remote, host: box-1, device: cpu}}
  - {{name: r2, launch: remote, host: box-2, device: cpu}}
""")
    run_dir = tmp_path / "run"
    env = hetlaunch_env()
    env.pop("HETLAUNCH_TOKEN", None)  # only the file may carry the token
    up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), "--token-file", str(token_file), env=env)
    agents: dict[str, subprocess.Popen] = {}
    try:
        contact = run_dir / "coordinator.json"
        wait_for(contact.exists, 30, "coordinator.json", proc=up)
        address = wait_for(lambda: json.loads(contact.read_text() or "{}").get("address"), 10,
                           "the address in coordinator.json", proc=up)
        for name in ("r0", "r1", "r2"):
            agents[name] = subprocess.Popen(
                hetlaunch_cmd("agent", "--coordinator", address, "--token-file", str(token_file), "--name", name,
                              "--connect-timeout", "20"),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=hetlaunch_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
        results = {name: p.communicate(timeout=100) for name, p in agents.items()}
        up.wait(timeout=30)
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
        up_out, up_err = stop_process(up)
    for name, p in agents.items():
        assert p.returncode == 0, f"agent {name} exited {p.returncode}:\n{results[name][1]}"
    assert up.returncode == 0, up_err + up_out
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(STEPS))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    # The planner may leave slow or surplus nodes out, or run several pipelines; each trains the whole model.
    stages = summary["plan"]["stages"]
    assert {s["node"] for s in stages} <= {"r0", "r1", "r2"}
    for p in range(len(summary["plan"]["pipeline_microbatches"])):
        mine = [s for s in stages if s["pipeline"] == p]
        assert [s["layer_start"] for s in mine] == [0] + [s["layer_end"] for s in mine[:-1]]
        assert mine[-1]["layer_end"] == 4
    assert all([s["node"] for s in r["stages"]] == [s["node"] for s in stages] for r in lines)
    assert (run_dir / "token").read_text().strip() == "s3cret-join-token"
    assert "s3cret-join-token" not in up_out + up_err


@pytest.mark.timeout(150)
def test_user_model_entrypoint_trains(tmp_path):
    steps = 30
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""
name: user-model
model: {{entrypoint: "user_model:make_mlp_lm", kwargs: {{seq_len: 16}}}}
train: {{steps: {steps}, micro_batch_size: 4, num_microbatches: 2, lr: 1.0e-2}}
nodes:  # pinned, so the user's layers are split across two processes whatever a profile would say
  - {{name: u0, device: cpu, threads: 1, layers: [0, 3]}}
  - {{name: u1, device: cpu, threads: 1, layers: [3, 5]}}
""")
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir), timeout=120)  # tests/ on PYTHONPATH
    assert result.returncode == 0, result.stderr + result.stdout
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == steps
    summary = json.loads((run_dir / "summary.json").read_text())
    # make_mlp_lm has 5 stage layers (embedding, 3 residual MLPs, head).
    assert [(s["node"], s["layer_start"], s["layer_end"]) for s in summary["plan"]["stages"]] == [
        ("u0", 0, 3), ("u1", 3, 5)]
    start, end = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert end < start - 0.3, (start, end, losses)


def test_entrypoint_kwargs_keep_their_types_across_the_control_plane():
    # kwargs ride in a protobuf Struct, where every number is a double; sizes must come back as int.
    kwargs = {"seq_len": 16, "d": 32, "scale": 0.5, "name": "mlp", "flag": True, "nested": {"sizes": [1, 2]}}
    spec = ModelSpec(entrypoint="user_model:make_mlp_lm", kwargs=kwargs)
    back = model_spec_from_proto(model_spec_to_proto(spec))
    assert back.entrypoint == spec.entrypoint
    assert back.kwargs == kwargs
    assert type(back.kwargs["seq_len"]) is int and type(back.kwargs["d"]) is int
    assert type(back.kwargs["scale"]) is float and type(back.kwargs["flag"]) is bool
    assert [type(v) for v in back.kwargs["nested"]["sizes"]] == [int, int]
    assert back.seq_len == 16
