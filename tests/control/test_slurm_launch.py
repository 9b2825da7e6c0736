"""launch: slurm against a real Slurm (slurmctld, two slurmd, munge) that tests/slurm_cluster.py
starts on this machine: `up` gets an allocation with salloc, starts the agents with srun (the token
on stdin), trains, and gives the allocation back however it ends; a job Slurm refuses is one line."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from conftest import hetlaunch_env, popen_hetlaunch, run_hetlaunch, session_processes, stop_process, wait_for
from slurm_cluster import slurm_missing, start_slurm


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if slurm_missing() is not None:
        pytest.skip(slurm_missing())
    try:
        cluster = start_slurm(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as err:
        pytest.skip(f"the test Slurm cluster did not start: {str(err).splitlines()[0]}")
    yield cluster
    cluster.stop()


def _yaml(nodes: list[str], steps: int, group: str = "{name: g, time: '10'}") -> str:
    return f"""
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
coordinator: {{join_timeout_s: 60}}
slurm:
  - {group}
nodes:
{chr(10).join('  - ' + n for n in nodes)}
"""


def _up(slurm, tmp_path, text: str):
    (tmp_path / "c.yaml").write_text(text)
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir),
                         env=hetlaunch_env(SLURM_CONF=str(slurm.conf)))
    return up, run_dir


def _no_jobs_within(slurm, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not slurm.jobs(), slurm.run("squeue").stdout


def _no_salloc_within(seconds: float) -> None:
    """No salloc of this session left: a salloc sent SIGTERM after its allocation started ignored it
    and spun at half a core once the job was gone (the wrapper's first version, review)."""
    deadline = time.monotonic() + seconds
    while session_processes("salloc") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_processes("salloc"), [p.cmdline()[:3] for p in session_processes("salloc")]


def _slurm_agents() -> list[psutil.Process]:
    """This test session's agents started through srun, and their srun (never another session's)."""
    return session_processes("hetlaunch.runtime.agent", "--stdin-lifeline")


@pytest.mark.timeout(150)
def test_two_agents_in_one_allocation_train_and_the_job_ends_with_up(slurm, tmp_path):
    nodes = ["{name: s0, launch: slurm, device: cpu}", "{name: s1, launch: slurm, device: cpu}"]
    group = "{name: g, partition: debug, gpus_per_node: 1, time: '10'}"  # the GPUs: Slurm's fake ones
    up, run_dir = _up(slurm, tmp_path, _yaml(nodes, steps=3, group=group))
    token, seen_job, seen_srun = None, False, False
    try:
        while up.poll() is None:  # the token is on no command line (srun's, the agents')
            token = token or ((run_dir / "token").exists() and (run_dir / "token").read_text().strip())
            for proc in psutil.process_iter(["cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                assert not token or token not in cmd, f"the token is on a command line: {cmd[:200]}"
                seen_srun |= cmd.startswith("srun --jobid=")
            seen_job |= bool(slurm.jobs())
            time.sleep(0.3)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    assert seen_job and seen_srun, "never saw the job or the agents' srun"
    assert "slurm group g: job " in out, out
    assert "s0 on n1 (gres gpu:fake:1), s1 on n2 (gres gpu:fake:1)" in out, out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    for name in ("s0", "s1"):
        assert f"[agent {name}] registered with" in (run_dir / "logs" / f"{name}.log").read_text()
    _no_jobs_within(slurm, 15)  # the allocation was given back; conftest checks no agent is left


@pytest.mark.timeout(150)
def test_a_slurm_node_and_a_local_node_train_together(slurm, tmp_path):
    nodes = ["{name: s0, launch: slurm, device: cpu, host: n2}", "{name: here, device: cpu}"]
    up, run_dir = _up(slurm, tmp_path, _yaml(nodes, steps=3))
    try:
        up.wait(timeout=120)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    assert "s0 on n2" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert "[agent s0] registered with" in (run_dir / "logs" / "s0.log").read_text()
    assert "[agent here] registered with" in (run_dir / "logs" / "here.log").read_text()
    _no_jobs_within(slurm, 15)


@pytest.mark.timeout(150)
def test_two_groups_of_one_het_job_are_one_heterogeneous_slurm_job(slurm, tmp_path):
    groups = ("{name: plain, het_job: j, partition: debug}\n"
              "  - {name: gpus, het_job: j, gpus_per_node: 1}")
    nodes = ["{name: p0, launch: slurm, slurm: plain, device: cpu}", "{name: g0, launch: slurm, slurm: gpus, device: cpu}"]
    up, run_dir = _up(slurm, tmp_path, _yaml(nodes, steps=2, group=groups))
    try:
        up.wait(timeout=120)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    assert "slurm group plain: job " in out and "(heterogeneous job j, component 0), agents p0 on n" in out, out
    assert "slurm group gpus: job " in out and "(heterogeneous job j, component 1), agents g0 on n" in out, out
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    _no_jobs_within(slurm, 15)


@pytest.mark.timeout(60)
def test_a_job_slurm_refuses_is_one_line(slurm, tmp_path):
    up, _ = _up(slurm, tmp_path, _yaml(["{name: s0, launch: slurm}"], steps=1,
                                       group="{name: g, partition: nosuchpart}"))
    up.wait(timeout=45)
    out, err = stop_process(up)
    assert up.returncode == 1, out + err
    lines = [line for line in err.splitlines() if "nosuchpart" in line]
    assert lines == [("error: slurm group g (1 node(s), partition nosuchpart): Slurm refused the allocation: "
                      "invalid partition specified: nosuchpart; Job submit/allocate failed: "
                      "Invalid partition name specified")], out + err
    _no_jobs_within(slurm, 15)


@pytest.mark.timeout(60)
def test_an_allocation_that_does_not_start_in_time_is_one_line_and_cancelled(slurm, tmp_path):
    group = "{name: g, wait_s: 3, salloc_options: [--begin=now+1hour]}"  # held pending by Slurm
    up, _ = _up(slurm, tmp_path, _yaml(["{name: s0, launch: slurm}"], steps=1, group=group))
    up.wait(timeout=45)
    out, err = stop_process(up)
    assert up.returncode == 1, out + err
    assert "slurm group g (1 node(s)): Slurm did not start job " in err, out + err
    assert "within 3s (slurm wait_s); it is PENDING (BeginTime)" in err, out + err
    _no_jobs_within(slurm, 15)


@pytest.mark.timeout(150)
def test_sigterm_on_up_cancels_the_allocation_and_stops_the_agents(slurm, tmp_path):
    up, run_dir = _up(slurm, tmp_path, _yaml(["{name: s0, launch: slurm, device: cpu}",
                                              "{name: s1, launch: slurm, device: cpu}"], steps=100000))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip(),
                 90, "a first step", proc=up)
        assert slurm.jobs() and _slurm_agents(), "no job or no agents while training"
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=40)
    finally:
        out, err = stop_process(up)
    assert up.returncode != 0, out + err
    _no_jobs_within(slurm, 15)
    _no_salloc_within(20)
    deadline = time.monotonic() + 15
    while _slurm_agents() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _slurm_agents(), "agents left running after SIGTERM"


@pytest.mark.timeout(120)
def test_sigkill_on_up_still_gives_the_allocation_back(slurm, tmp_path):
    """Nobody runs scancel: the closed pipes end salloc's holding command and the agents' lifelines."""
    up, run_dir = _up(slurm, tmp_path, _yaml(["{name: s0, launch: slurm, device: cpu}"], steps=100000))
    _kill_up_once(slurm, up, lambda: (run_dir / "metrics.jsonl").exists()
                  and (run_dir / "metrics.jsonl").read_text().strip(), 90, "a first step")
    deadline = time.monotonic() + 15
    while _slurm_agents() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _slurm_agents(), "agents left running after SIGKILL of up"


@pytest.mark.timeout(120)
def test_sigkill_on_up_while_the_allocation_is_queued_withdraws_it(slurm, tmp_path):
    """A queued request has no command holding it yet: the shell around salloc sees `up`'s pipe
    close and sends salloc SIGTERM (a hostile review left one queued after SIGKILL of `up`)."""
    group = "{name: g, wait_s: 600, salloc_options: [--begin=now+1hour]}"  # held pending by Slurm
    up, _ = _up(slurm, tmp_path, _yaml(["{name: s0, launch: slurm}"], steps=1, group=group))
    _kill_up_once(slurm, up, lambda: slurm.jobs(), 60, "the queued job")


def _kill_up_once(slurm, up, ready, within_s: float, what: str) -> None:
    """SIGKILL `up` once `ready()` holds; then no job and no salloc of the session may be left."""
    try:
        wait_for(ready, within_s, what, proc=up)
        up.kill()
        up.wait(timeout=10)
    finally:
        stop_process(up)
    _no_jobs_within(slurm, 20)
    _no_salloc_within(20)


@pytest.mark.timeout(300)
def test_a_failed_slurm_node_is_a_lost_node_and_the_others_train_on(slurm, tmp_path):
    """The allocation has --no-kill: Slurm ends only the failed node's step, `up` re-plans on the other.
    The job trains until the loss is recorded and 3 steps past it, then `hetlaunch down` (12 steps
    could end first). Under load the planner may leave s1 out (the loopback link measured slow):
    its loss is then an event, not a console line, and the job trains on all the same."""
    up, run_dir = _up(slurm, tmp_path, _yaml(["{name: s0, launch: slurm, device: cpu}",
                                              "{name: s1, launch: slurm, device: cpu}"], steps=100_000))
    metrics = run_dir / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.read_text().strip(), 90, "a first step", proc=up)
        down = slurm.run("scontrol", "update", "nodename=n2", "state=down", "reason=hetlaunch-test")
        assert down.returncode == 0, down.stderr
        wait_for(lambda: _lost(run_dir), 90, "the lost node", proc=up)
        lost_at = len(metrics.read_text().splitlines())
        wait_for(lambda: len(metrics.read_text().splitlines()) >= lost_at + 3, 90, "3 steps after the loss", proc=up)
        stopped = run_hetlaunch("down", str(run_dir), timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        up.wait(timeout=120)
    finally:
        out, err = stop_process(up)
        slurm.run("scontrol", "update", "nodename=n2", "state=resume")
    assert up.returncode == 0, out + err
    lost = _lost(run_dir)
    assert [e["node"] for e in lost] == ["s1"], lost
    assert lost[0]["why"].startswith("agent started with srun exited") and "Node failure on n2" in lost[0]["why"], lost
    if lost[0]["in_plan"]:
        assert "lost node s1: agent started with srun exited" in out, out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert sorted(set(steps)) == list(range(max(steps) + 1)) and max(steps) >= lost_at + 1, steps
    _no_jobs_within(slurm, 15)
    wait_for(lambda: "n2" in slurm.idle_nodes(), 30, "n2 idle again")


def _lost(run_dir) -> list[dict]:
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == "lost"]


@pytest.mark.timeout(60)
def test_without_slurm_commands_on_path_up_is_one_line_before_anything_starts(tmp_path):
    """Said before the run directory, the coordinator or a local agent exists: it was said only once
    they had started, and the run directory stayed behind (a hostile review)."""
    (tmp_path / "c.yaml").write_text(_yaml(["{name: s0, launch: slurm}", "{name: here}"], steps=1))
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"), timeout=50,
                           env=hetlaunch_env(PATH=str(tmp_path)))
    assert result.returncode == 1 and result.stderr.strip() == (
        "error: launch: slurm needs Slurm's client commands on PATH on this machine, and salloc, srun, scancel, "
        "squeue, scontrol are not (install slurm-client)"), result.stderr
    assert not (tmp_path / "run").exists()
