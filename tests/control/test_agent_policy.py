"""An agent refuses what its operator did not allow — a model entrypoint, a data file, a
checkpoint directory — and the job ends with one line naming the rule."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import hetlaunch_cmd, hetlaunch_env, popen_hetlaunch, stop_process, wait_for
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.policy import AgentPolicy, PolicyRefusal


def test_the_policy_names_the_rule_it_applies(tmp_path):
    policy = AgentPolicy.of(["mypkg.*:build"], [tmp_path / "data"], [tmp_path / "ckpt"], tmp_path / "work")
    run = pb.RunStage()
    run.model.entrypoint.entrypoint = "mypkg.models:build"
    policy.check_run_stage(run)  # allowed by the pattern
    run.model.entrypoint.entrypoint = "logging:basicConfig"
    with pytest.raises(PolicyRefusal, match=r"entrypoint 'logging:basicConfig' is not allowed \(--allow-entrypoint: "
                                            r"mypkg\.\*:build\)"):
        policy.check_run_stage(run)
    run.model.entrypoint.entrypoint = "mypkg.models:build"
    run.data.path = str(tmp_path / "data" / ".." / "secret.txt")  # resolved before it is judged
    with pytest.raises(PolicyRefusal, match="data.path .* is outside every --data-root"):
        policy.check_run_stage(run)
    run.data.path = str(tmp_path / "data" / "train.bin")
    policy.check_run_stage(run)
    run.train.checkpoint_dir = "/etc/hetlaunch"
    with pytest.raises(PolicyRefusal, match="checkpoint directory '/etc/hetlaunch' is outside every --checkpoint-root"):
        policy.check_paths(run)
    run.train.checkpoint_dir = str(tmp_path / "work" / "checkpoints")  # the agent's own work dir is always allowed
    policy.check_paths(run)
    closed = AgentPolicy.of([], [], [], tmp_path / "work")
    with pytest.raises(PolicyRefusal, match="none: only the built-in GPT"):
        closed.check_model(run.model)
    run.data.path = "/etc/passwd"
    run.model.ClearField("entrypoint")
    run.model.gpt.d_model = 8
    with pytest.raises(PolicyRefusal, match="none: only the built-in text"):
        closed.check_run_stage(run)


def _job_with_one_remote_agent(tmp_path: Path, agent_args: list[str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    token_file = tmp_path / "token"
    token_file.write_text("policy-token\n")
    token_file.chmod(0o600)
    yaml = tmp_path / "cluster.yaml"
    yaml.write_text("""name: policy
model: {entrypoint: "user_model:make_mlp_lm", kwargs: {d: 16, n_hidden: 2, seq_len: 16}}
coordinator: {host: 127.0.0.1, join_timeout_s: 40}
train: {steps: 2, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}
nodes:
  - {name: r, launch: remote, device: cpu}
""")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml), "--run-dir", str(run_dir), "--token-file", str(token_file))
    try:
        contact = run_dir / "coordinator.json"
        address = wait_for(lambda: contact.exists() and json.loads(contact.read_text() or "{}").get("address"), 30,
                           "the coordinator's address", proc=up)
        agent = subprocess.run(hetlaunch_cmd("agent", "--coordinator", address, "--token-file", str(token_file),
                                             "--name", "r", "--connect-timeout", "10", *agent_args),
                               capture_output=True, text=True, timeout=120, env=hetlaunch_env(OMP_NUM_THREADS="1"))
        up.wait(timeout=60)
    finally:
        out, err = stop_process(up, grace_s=10)
    return agent, up.returncode, err


@pytest.mark.timeout(200)
def test_a_remote_agent_runs_a_user_model_only_when_its_operator_allows_it(tmp_path):
    agent, rc, err = _job_with_one_remote_agent(tmp_path / "closed", [])
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 1 and len(errors) == 1, err
    assert "refused by this agent's policy: model entrypoint 'user_model:make_mlp_lm' is not allowed" in errors[0]
    assert "r" in errors[0] and "Traceback" not in err
    agent, rc, err = _job_with_one_remote_agent(tmp_path / "open", ["--allow-entrypoint", "user_model:*"])
    assert rc == 0 and agent.returncode == 0, err + agent.stderr
