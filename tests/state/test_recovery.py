"""A run survives losing a node: real agents, real workers, real gloo, real signals.

Each test starts `hetlaunch up` on a small pinned cluster, hurts one process at a step in
the middle of the run, and checks that the job finishes every step on the survivors — and,
where it says so, that what it computed after the restore equals a fault-free run started
from the same checkpoint on the same plan.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import psutil
import pytest

from conftest import hetlaunch_env, popen_hetlaunch, run_hetlaunch, session_processes, stop_process, wait_for
from fault_run import agent_process, events, metrics, run_and_hurt, steps_done, worker_of

STEPS = 60


# Heartbeats every 0.5 s; a node is lost after 10 s of silence. A shorter timeout is a bet on
# the scheduler: under a loaded 2-core machine an agent (or the coordinator's server thread)
# can go unscheduled for seconds, and a healthy node would be declared lost.
HEARTBEAT_TIMEOUT_S = 10


# A fault made once step N is logged lands a while after the workers passed it: agents send their
# step reports every 0.5 s (runtime/step_reporter.py) and a loaded coordinator logs them late,
# while a step of these tiny models takes some 20 ms, so a few dozen steps can pass. A test whose
# fault must land before some later step slows every node for SLOW_STEPS steps from N (a sleep:
# runtime/emulation.py, which stretches the time compute took, so a load that delays the log
# lengthens these steps too) and turns rebalancing off (all nodes slow at once is no straggler
# to move layers off, but the watch would be asked).
SLOW_SPEED, SLOW_STEPS = 0.005, 4


def cluster_yaml(pinned: list[tuple[str, int, int, int]], steps: int = STEPS, every: int = 5, extra: str = "",
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, train_extra: str = "",
                 slow_at: int | None = None, slow_speed: float = SLOW_SPEED, memory_gb: float | None = None) -> str:
    emulate = {} if memory_gb is None else {"memory_gb": memory_gb}
    if slow_at is not None:
        emulate["speed_changes"] = [{"at_step": slow_at, "speed": slow_speed},
                                    {"at_step": slow_at + SLOW_STEPS, "speed": 1.0}]
        train_extra += ", rebalance: off"
    node_extra = f", emulate: {json.dumps(emulate)}" if emulate else ""
    nodes = "\n".join(f"  - {{name: {name}, device: cpu, threads: 1, layers: [{a}, {b}], pipeline: {p}{node_extra}}}"
                      for name, a, b, p in pinned)
    return f"""name: ft
coordinator: {{heartbeat_interval_s: 0.5, heartbeat_timeout_s: {heartbeat_timeout_s}}}
model: {{preset: tiny, n_layers: 2, seq_len: 32, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 4, num_microbatches: 4, checkpoint_every: {every}{train_extra}}}
compression: {{intra_region: none, cross_region: none, sync: none}}  # exact numerics: nothing lossy
{extra}
nodes:
{nodes}
"""


TWO_PIPELINES = [("n0", 0, 2, 0), ("n1", 2, 4, 0), ("n2", 0, 2, 1), ("n3", 2, 4, 1)]


def assert_every_step_once(run_dir: Path, steps: int = STEPS) -> list[dict]:
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps)), "a step is missing or logged twice"
    return records


def assert_every_step_recorded_or_said(run_dir: Path, output: str, steps: int = STEPS) -> None:
    """Where an agent is lost (killed or stopped, not only its worker), the step reports it had
    not yet sent (agents send them every 0.5 s) go with it: a step the survivors' state includes
    may then have no line. Each step is recorded once or named in an `unrecorded` event and on
    the console, those are few and before the restored step, and none is recorded twice."""
    recorded = [r["step"] for r in metrics(run_dir)]
    log = events(run_dir)
    unrecorded = [s for e in log if e["event"] == "unrecorded" for s in e["steps"]]
    assert sorted(recorded + unrecorded) == list(range(steps)) and len(set(recorded)) == len(recorded), \
        (recorded, unrecorded)
    if unrecorded:
        restored = max(e["step"] for e in log if e["event"] == "restore")
        assert len(unrecorded) <= 3 and max(unrecorded) < restored, (unrecorded, restored)
        assert f"no report came of step(s) {', '.join(map(str, unrecorded))}" in output, output


def resume_on(tmp_path: Path, source_run: Path, checkpoint: Path, plan: dict, name: str, steps: int = STEPS,
              train_extra: str = "") -> Path:
    """A fault-free run that starts from `checkpoint` on `plan`'s cut: a run directory holding only
    that checkpoint and the steps before it, resumed with the plan's layers pinned."""
    step = int(checkpoint.name.split("-")[1])
    run_dir = tmp_path / name
    shutil.copytree(checkpoint, run_dir / "checkpoints" / checkpoint.name)
    kept = [line for line in (source_run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] < step]
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    pinned = [(s["node"], s["layer_start"], s["layer_end"], s["pipeline"]) for s in plan["stages"]]
    yaml_path = tmp_path / f"{name}.yaml"
    yaml_path.write_text(cluster_yaml(pinned, steps=steps, train_extra=train_extra))
    result = run_hetlaunch("up", str(yaml_path), "--resume", str(run_dir), timeout=150)
    assert result.returncode == 0, result.stderr + result.stdout
    return run_dir


def assert_losses_equal(got: list[dict], want: list[dict], from_step: int) -> None:
    pairs = [(g["loss"], w["loss"]) for g, w in zip(got, want) if g["step"] >= from_step]
    assert pairs, "no step after the restore to compare"
    for g, w in pairs:
        assert abs(g - w) / abs(w) <= 1e-5, (g, w)


@pytest.mark.timeout(300)
def test_killed_worker_run_finishes_and_matches_a_fault_free_run_from_the_same_state(tmp_path):
    keep_all = "checkpoint: {keep: 1000}  # the restore's checkpoint is loaded again below"
    # No checkpoint before step 50: the kill at ~12 cannot land on a checkpoint's step, where the file
    # would rightly be chosen over snapshots no newer than it.
    run_dir, rc, stderr, _ = run_and_hurt(tmp_path, cluster_yaml(TWO_PIPELINES, every=50, extra=keep_all, slow_at=12),
                                          lambda: worker_of("n3").send_signal(signal.SIGKILL), at_step=12)
    assert rc == 0, stderr
    records = assert_every_step_once(run_dir)
    log = events(run_dir)
    lost = [e for e in log if e["event"] == "lost"]
    assert [e["node"] for e in lost] == ["n3"] and "SIGKILL" in lost[0]["why"], lost
    restore = [e for e in log if e["event"] == "restore"][-1]
    # Both pipelines held n3's layers: the survivors' snapshots stand in, at or after the kill.
    assert restore["source"] == "replica", log
    assert restore["step"] >= 12
    restart = next(e for e in log if e["event"] == "restart")
    assert restart["lost_steps"] == 0
    last_generation = [e for e in log if e["event"] == "generation"][-1]
    assert "n3" not in {s["node"] for s in last_generation["plan"]["stages"]}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["events"]["lost"] == 1

    reference = resume_on(tmp_path, run_dir, Path(restore["directory"]), last_generation["plan"], "reference")
    assert_losses_equal(records, metrics(reference), restore["step"])


@pytest.mark.timeout(300)
def test_a_worker_killed_in_a_step_that_evaluates_in_its_bubbles_loses_no_held_out_loss(tmp_path):
    """With `eval_every: 1` every step carries the evaluation due after the step before it (E
    actions in its bubbles; the last stage holds that step's record until the loss comes), so the
    kill lands in such a step whenever it comes. Every step is still recorded once, each with its
    held-out loss, and those after the restore equal a fault-free run from the same state."""
    steps, evaluate = 30, ", eval_every: 1, eval_microbatches: 2"
    run_dir, rc, stderr, _ = run_and_hurt(
        tmp_path, cluster_yaml(TWO_PIPELINES, steps=steps, every=50, train_extra=evaluate, slow_at=12),
        lambda: worker_of("n3").send_signal(signal.SIGKILL), at_step=12)
    assert rc == 0, stderr
    records = assert_every_step_once(run_dir, steps)
    assert all(isinstance(r.get("eval_loss"), float) and r["eval_loss"] > 0 for r in records), records
    log = events(run_dir)
    restore = [e for e in log if e["event"] == "restore"][-1]
    assert restore["source"] == "replica" and restore["step"] >= 12, log
    last_generation = [e for e in log if e["event"] == "generation"][-1]
    reference = metrics(resume_on(tmp_path, run_dir, Path(restore["directory"]), last_generation["plan"], "reference",
                                  steps=steps, train_extra=evaluate))
    pairs = [(g["eval_loss"], w["eval_loss"]) for g, w in zip(records, reference) if g["step"] >= restore["step"]]
    assert pairs and all(abs(g - w) / abs(w) <= 1e-5 for g, w in pairs), pairs
    assert_losses_equal(records, reference, restore["step"])


@pytest.mark.timeout(300)
def test_killed_agent_run_finishes_on_the_survivors(tmp_path):
    run_dir, rc, stderr, _ = run_and_hurt(tmp_path, cluster_yaml(TWO_PIPELINES, slow_at=12),
                                          lambda: agent_process("n1").send_signal(signal.SIGKILL), at_step=12)
    assert rc == 0, stderr
    assert_every_step_recorded_or_said(run_dir, stderr)
    lost = [e for e in events(run_dir) if e["event"] == "lost"]
    assert [e["node"] for e in lost] == ["n1"], lost
    assert "recovering: lost node n1" in stderr, stderr  # the progress output says the job is recovering
    # ... and that it could (on the nodes the re-plan uses: it may leave n1's pipeline partner out)
    assert re.search(r"recovered: resuming at step \d+ from the (survivors' replicas|last checkpoint) on [23] node\(s\)",
                     stderr), stderr


@pytest.mark.timeout(300)
def test_sigstopped_agent_is_detected_within_the_heartbeat_timeout(tmp_path):
    stopped = []

    def stop():
        agent = agent_process("n3")
        stopped.append(agent)
        agent.send_signal(signal.SIGSTOP)

    try:
        run_dir, rc, stderr, stopped_at = run_and_hurt(tmp_path, cluster_yaml(TWO_PIPELINES, heartbeat_timeout_s=4, slow_at=10),
                                                       stop, at_step=10)
    finally:
        for agent in stopped:  # SIGKILLed by `up` when declared lost; never leave a stopped process behind
            if agent.is_running():
                agent.send_signal(signal.SIGCONT)
    assert rc == 0, stderr
    assert_every_step_recorded_or_said(run_dir, stderr)
    lost = [e for e in events(run_dir) if e["event"] == "lost"]
    assert [e["node"] for e in lost] == ["n3"] and "no heartbeat" in lost[0]["why"], lost
    # heartbeat_timeout_s is 4: declared lost after the stop and not much later (the slack is the
    # coordinator's polling and a loaded machine's scheduling). Not 4 s after the stop at the least:
    # a loaded machine can leave a healthy agent's last beat seconds old when it is stopped.
    assert 0 <= lost[0]["time"] - stopped_at <= 4 + 10, lost[0]["time"] - stopped_at


WATCHDOG_S = 5


@pytest.mark.timeout(300)
def test_a_frozen_worker_is_found_by_the_watchdog_and_a_replica_stands_in(tmp_path):
    """SIGSTOP of a worker (what a hung collective or a stuck data loader looks like): its agent
    heartbeats on, so only the progress watchdog can find it. It is named within twice the
    watchdog's bound, the node is recovered like a lost one, and no step is lost."""
    stopped = []

    def freeze():
        worker = worker_of("n3")
        stopped.append(worker)
        worker.send_signal(signal.SIGSTOP)

    # The first checkpoint is at step 50, long after the freeze: with one every 5 steps, a freeze that
    # landed just after a checkpoint's step (the stages run a few steps ahead of the log) left the
    # snapshots no newer than the file, and the file was rightly chosen (a CI run, 2026-12-03).
    # Its slow steps are 1/50 of the speed, not 1/200: a waiting stage that sees no step for 1.5
    # watchdog bounds is killed too.
    yaml_text = cluster_yaml(TWO_PIPELINES, every=50, train_extra=f", watchdog_s: {WATCHDOG_S}", slow_at=12,
                             slow_speed=0.02)
    try:
        run_dir, rc, stderr, frozen_at = run_and_hurt(tmp_path, yaml_text, freeze, at_step=12)
    finally:
        for worker in stopped:
            if worker.is_running():
                worker.send_signal(signal.SIGCONT)
    assert rc == 0, stderr
    assert_every_step_once(run_dir)
    log = events(run_dir)
    lost = [e for e in log if e["event"] == "lost"]
    assert [e["node"] for e in lost] == ["n3"] and "frozen (process state stopped)" in lost[0]["why"], lost
    assert lost[0]["time"] - frozen_at <= 2 * WATCHDOG_S, lost[0]["time"] - frozen_at
    assert [e["source"] for e in log if e["event"] == "restore"][-1] == "replica", log
    assert next(e for e in log if e["event"] == "restart")["lost_steps"] == 0
    assert not stopped[0].is_running() or stopped[0].status() == psutil.STATUS_ZOMBIE  # killed, not left frozen


@pytest.mark.timeout(300)
def test_resume_after_up_was_killed_continues_without_logging_a_step_twice(tmp_path):
    pinned = [("n0", 0, 2, 0), ("n1", 2, 4, 0)]
    yaml_text = cluster_yaml(pinned, slow_at=17)  # the kill of `up` lands mid-run
    holder = {}
    run_dir, rc, _, _ = run_and_hurt(tmp_path, yaml_text, lambda: holder.setdefault("killed", True), at_step=0)
    assert rc == 0  # (a plain run first: the reference)
    reference = metrics(run_dir)

    (tmp_path / "cluster.yaml").write_text(yaml_text)
    second = tmp_path / "killed"
    proc = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(second))
    try:
        wait_for(lambda: (second / "checkpoints").exists() and any((second / "checkpoints").glob("step-*/manifest.json"))
                 and steps_done(second) >= 17, 90, "a committed checkpoint and step 17", proc, interval=0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        stop_process(proc)
    # The agents notice their parent is gone and exit, taking their workers with them.
    wait_for(lambda: not (session_processes("hetlaunch.runtime.agent") + session_processes("hetlaunch.runtime.worker")),
             15, "the killed run's agents and workers to exit")
    logged_before = steps_done(second)
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--resume", str(second), timeout=150)
    assert result.returncode == 0, result.stderr + result.stdout
    records = assert_every_step_once(second)
    resume = next(e for e in events(second) if e["event"] == "resume")
    assert 5 <= resume["step"] <= logged_before
    # The same plan from the same state: the resumed steps equal the uninterrupted run's.
    assert_losses_equal(records, reference, 0)


@pytest.mark.timeout(300)
def test_checkpoint_of_one_pipeline_resumes_on_two_pipelines_of_other_cuts(tmp_path):
    one = [("n0", 0, 2, 0), ("n1", 2, 4, 0)]
    run_dir, rc, stderr, _ = run_and_hurt(tmp_path, cluster_yaml(one, steps=20, every=10), lambda: None, at_step=0)
    assert rc == 0, stderr
    records = assert_every_step_once(run_dir, 20)
    checkpoint = run_dir / "checkpoints" / "step-00000010"
    two = {"stages": [{"node": n, "layer_start": a, "layer_end": b, "pipeline": p}
                      for n, a, b, p in [("n0", 0, 1, 0), ("n1", 1, 4, 0), ("n2", 0, 3, 1), ("n3", 3, 4, 1)]]}
    resumed = resume_on(tmp_path, run_dir, checkpoint, two, "resharded", steps=20)
    got = metrics(resumed)
    assert [r["step"] for r in got] == list(range(20))
    assert_losses_equal(got, records, 10)


@pytest.mark.timeout(300)
def test_loss_no_survivor_can_hold_ends_with_one_line_naming_the_shortfall(tmp_path):
    # Each node reports 1 MiB: the model (about 1.3 MiB with its AdamW state) needs both.
    pinned = [("n0", 0, 2, 0), ("n1", 2, 4, 0)]
    yaml_text = cluster_yaml(pinned, memory_gb=0.0009765625, slow_at=5)
    run_dir, rc, stderr, _ = run_and_hurt(tmp_path, yaml_text, lambda: worker_of("n1").send_signal(signal.SIGKILL),
                                          at_step=5)
    assert rc == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    line = errors[0]
    assert "n0" in line and "short" in line and "MiB" in line, line
    assert "Traceback" not in stderr


@pytest.mark.timeout(300)
def test_a_worker_killed_before_the_first_step_does_not_hold_recovery_for_snapshots(tmp_path):
    """With no step taken the survivors' snapshots cannot be newer than the start, yet recovery
    waited the whole snapshot window (20 s) for survivors that never wrote one. Step 0 is slowed
    (speed 0.005 from step 0) so that the kill lands before any step, whatever the load."""
    (tmp_path / "cluster.yaml").write_text(cluster_yaml(TWO_PIPELINES, steps=12, slow_at=0))
    run_dir = tmp_path / "run"
    proc = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "events.jsonl").exists()
                 and any(e["event"] == "generation" for e in events(run_dir)), 90, "the first generation", proc)
        wait_for(lambda: _running_a_stage("n3"), 60, "n3's worker running its stage", proc)
        worker_of("n3").send_signal(signal.SIGKILL)
        proc.wait(timeout=200)
    finally:
        stdout, stderr = stop_process(proc)
    assert proc.returncode == 0, stderr + stdout
    log = events(run_dir)
    lost = next((e for e in log if e["event"] == "lost"), None)
    restart = next((e for e in log if e["event"] == "restart"), None)
    assert lost is not None and restart is not None, log
    assert restart["resume_step"] == 0 and restart["restore_source"] == "init", log
    assert not any(e["event"] == "snapshot" for e in log), log
    # The restart followed the loss by the re-plan only (1-2 s); it was the whole snapshot wait,
    # SNAPSHOT_WAIT_S = 20 s, and more (r27 of the review).
    assert restart["time"] - lost["time"] < 15, (lost, restart)
    assert_every_step_once(run_dir, 12)


def _running_a_stage(node: str) -> bool:
    """The node's worker has taken its stage: connected to the rendezvous store. A spare worker
    (started warm before its task) has only its pipe: killing it, the agent takes a new one and
    nothing is lost."""
    try:
        return bool(worker_of(node).net_connections(kind="tcp"))
    except (AssertionError, psutil.Error):
        return False


@pytest.mark.timeout(300)
def test_losing_every_node_is_one_error_line_not_a_recovery(tmp_path):
    """`recovering:` came first, naming one node, then the error that no node was left."""
    yaml_text = cluster_yaml([("n0", 0, 4, 0)], slow_at=5)
    run_dir, rc, stderr, _ = run_and_hurt(tmp_path, yaml_text, lambda: agent_process("n0").send_signal(signal.SIGKILL),
                                          at_step=5)
    assert rc == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: lost node n0: ") and \
        errors[0].endswith(": no node is left to train on"), stderr
    assert "recovering" not in stderr and "Traceback" not in stderr, stderr
    assert [e["node"] for e in events(run_dir) if e["event"] == "lost"] == ["n0"]


@pytest.mark.timeout(300)
def test_a_lost_node_the_plan_does_not_use_is_said_and_training_goes_on(tmp_path):
    """n2 reports 1 KiB of memory, so no plan can give it a layer: it is a spare. Its agent is
    killed once a step is logged; the console says so, the generation goes on (no restart), and
    the job trains 3 more steps before `hetlaunch down` stops it (it has steps enough not to end first)."""
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""name: spare
coordinator: {{heartbeat_interval_s: 0.5, heartbeat_timeout_s: {HEARTBEAT_TIMEOUT_S}}}
model: {{preset: tiny, n_layers: 2, seq_len: 32, d_model: 32}}
train: {{steps: 100000, micro_batch_size: 4, num_microbatches: 4, checkpoint_every: 0}}
nodes:
  - {{name: n0, device: cpu, threads: 1}}
  - {{name: n1, device: cpu, threads: 1}}
  - {{name: n2, device: cpu, threads: 1, emulate: {{memory_gb: 0.000001}}}}
""")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: steps_done(run_dir) >= 1, 120, "a first step", up)
        plan = next(e for e in events(run_dir) if e["event"] == "generation")["plan"]
        assert "n2" in plan["excluded"] and "n2" not in {s["node"] for s in plan["stages"]}, plan
        agent_process("n2").send_signal(signal.SIGKILL)
        wait_for(lambda: [e for e in events(run_dir) if e["event"] == "lost"], 60, "the loss of n2", up)
        lost_at = steps_done(run_dir)
        wait_for(lambda: steps_done(run_dir) >= lost_at + 3, 90, "3 steps after the loss", up)
        stopped = run_hetlaunch("down", str(run_dir), timeout=30)
        assert stopped.returncode == 0, stopped.stderr
        up.wait(timeout=120)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, out + err
    assert [(e["node"], e["in_plan"]) for e in events(run_dir) if e["event"] == "lost"] == [("n2", False)]
    assert "lost node n2, which the plan does not use (local agent was killed by SIGKILL)" in out, out
    assert [e["event"] for e in events(run_dir)].count("generation") == 1
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(len(steps))) and len(steps) >= lost_at + 3, steps


def test_a_loss_of_several_nodes_names_them_all():
    """The account named the first lost node only: a user saw one node go where two had."""
    from hetlaunch.launcher.session import lost_message

    assert lost_message({"n1": "heartbeats stopped"}) == "lost node n1: heartbeats stopped"
    assert lost_message({"n1": "heartbeats stopped", "n3": "agent exited"}) == \
        "lost nodes n1, n3: n1: heartbeats stopped; n3: agent exited"


def test_a_peers_broken_connection_is_said_as_that_not_as_gloos_internals():
    """A recovery line read "then failed as a consequence: n1 (RuntimeError: [/__w/pytorch/pytorch/
    third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:65165: Connection reset by
    peer. This is typicall...)" (a hostile review)."""
    from hetlaunch.launcher.session import consequences

    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:65165: Connection reset by peer. This is typically caused by a peer dying")
    assert consequences({"n3": "the worker was killed by SIGKILL", "n1": gloo, "n2": "ValueError: bad shape"},
                        {"n3": "its stage failed"}) == \
        "; then failed as a consequence: n1 (its connection to a failed peer broke), n2 (ValueError: bad shape)"
    assert consequences({"n3": "killed"}, {"n3": "its stage failed"}) == ""
    watchdog = "RuntimeError: NCCL watchdog: collective operation timeout after 600000 ms"  # not a broken connection
    assert consequences({"n3": "killed", "n1": watchdog}, {"n3": "x"}) == f"; then failed as a consequence: n1 ({watchdog})"


# A model whose entrypoint kills the worker building it where the node runs 2 threads (the profile
# command sets the worker's threads before it builds the model): a worker that dies while its node's
# layers are timed, at that moment and no other, whatever the load.
DYING_MODEL = '''
import os, signal, sys
import torch
from user_model import make_mlp_lm

def build(**kwargs):
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main is not None and main.name == "hetlaunch.runtime.worker" and torch.get_num_threads() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return make_mlp_lm(**kwargs)
'''


def _dying_run(tmp_path: Path, nodes: str, timeout: float = 150, model: str = DYING_MODEL,
               train: str = "steps: 4, micro_batch_size: 2, num_microbatches: 2, max_pipelines: 1"):
    (tmp_path / "dying_model.py").write_text(model)
    (tmp_path / "cluster.yaml").write_text(f"""
model: {{entrypoint: "dying_model:build", kwargs: {{seq_len: 16}}}}
train: {{{train}}}
nodes:
{nodes}""")
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))  # measured now, never from a cache
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    return run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "run"), env=env,
                         timeout=timeout)


@pytest.mark.timeout(200)
def test_a_worker_that_dies_while_its_layers_are_timed_drops_its_node_not_the_job(tmp_path):
    result = _dying_run(tmp_path, "  - {name: u0, device: cpu, threads: 1}\n  - {name: u1, device: cpu, threads: 1}\n"
                                  "  - {name: u2, device: cpu, threads: 2}\n")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "lost node u2 while profiling (the worker was killed by SIGKILL): planning without it" in result.stdout
    run_dir = tmp_path / "run"
    assert [(e["node"], e["in_plan"]) for e in events(run_dir) if e["event"] == "lost"] == [("u2", False)]
    plan = next(e for e in events(run_dir) if e["event"] == "generation")["plan"]
    assert {s["node"] for s in plan["stages"]} <= {"u0", "u1"}
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2, 3]
    assert [n["name"] for n in json.loads((run_dir / "profile.json").read_text())["nodes"]] == ["u0", "u1"]


@pytest.mark.timeout(200)
def test_a_node_whose_alike_twin_died_while_profiling_is_timed_itself(tmp_path):
    """u1 takes u0's timings (one device of this machine, emulated alike: timed once); u0's worker
    died, so u1 was timed itself, and died too: both dropped, u2 trains alone."""
    result = _dying_run(tmp_path, "  - {name: u0, device: cpu, threads: 2}\n  - {name: u1, device: cpu, threads: 2}\n"
                                  "  - {name: u2, device: cpu, threads: 1}\n")
    assert result.returncode == 0, result.stderr + result.stdout
    for node in ("u0", "u1"):
        assert f"lost node {node} while profiling (the worker was killed by SIGKILL)" in result.stdout
    run_dir = tmp_path / "run"
    assert sorted(e["node"] for e in events(run_dir) if e["event"] == "lost") == ["u0", "u1"]
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2, 3]


# Dies like DYING_MODEL, but only once a micro-batch below 4 samples reaches the first layer: the
# second profiling pass, which times the smallest micro-batch size a global batch may be cut into.
DYING_AT_THE_SMALLER_SIZE = '''
import os, signal, sys
import torch
from torch import nn
from user_model import make_mlp_lm

class Watch(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        main = getattr(sys.modules.get("__main__"), "__spec__", None)
        if idx.shape[0] < 4 and main is not None and main.name == "hetlaunch.runtime.worker" \\
                and torch.get_num_threads() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(idx)

def build(**kwargs):
    layers, loss = make_mlp_lm(**kwargs)
    return [Watch(layers[0])] + layers[1:], loss
'''


@pytest.mark.timeout(200)
def test_a_node_dropped_while_the_smaller_batch_size_is_timed_leaves_the_plan(tmp_path):
    """measure_for_train merged the second pass's timings by node name: a KeyError on the dropped node."""
    result = _dying_run(tmp_path, "  - {name: u0, device: cpu, threads: 1}\n  - {name: u1, device: cpu, threads: 2}\n",
                        model=DYING_AT_THE_SMALLER_SIZE,
                        train="steps: 3, micro_batch_size: 4, global_batch: 8, max_pipelines: 1")
    assert result.returncode == 0, result.stderr + result.stdout
    assert "lost node u1 while profiling (the worker was killed by SIGKILL): planning without it" in result.stdout
    run_dir = tmp_path / "run"
    assert [n["name"] for n in json.loads((run_dir / "profile.json").read_text())["nodes"]] == ["u0"]
    from hetlaunch.launcher.planning.profile_file import load_profile
    # `plan --profile` replays it: the link probed to u1 left with u1 (load_profile refused it)
    assert not [link for link in load_profile(run_dir / "profile.json").links if "u1" in (link.nodes or ())]
    assert [r["step"] for r in metrics(run_dir)] == [0, 1, 2]


@pytest.mark.timeout(120)
def test_every_worker_dying_while_profiling_is_one_error_line(tmp_path):
    result = _dying_run(tmp_path, "  - {name: u0, device: cpu, threads: 2}\n")
    assert result.returncode == 1, result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: every node was lost while profiling: u0: the worker was killed by SIGKILL"], result.stderr
