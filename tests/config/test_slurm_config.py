"""The cluster YAML's slurm: groups and launch: slurm nodes (launcher/slurm_config.py): what they
accept, and one line naming the field for what they do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, error_of, run_hetlaunch
from hetlaunch.launcher.cluster_yaml import load_cluster, parse_cluster
from hetlaunch.launcher.providers.slurm import Component, salloc_command, salloc_errors

HEAD = "model: {preset: tiny}\n"


def test_the_example_loads_with_a_slurm_group_and_a_local_node():
    cfg = load_cluster(REPO / "cluster_examples" / "slurm.yaml")
    assert [g.name for g in cfg.slurm] == ["a100"]
    assert [(n.launch, n.slurm) for n in cfg.nodes] == [("slurm", "a100"), ("slurm", "a100"), ("local", None)]


def test_validate_counts_the_slurm_nodes(tmp_path):
    # validate reads the TLS files the example names (certs/..., from the current directory): made
    # as the example's users make them, with `hetlaunch certs init certs`
    made = run_hetlaunch("certs", "init", "certs", "--host", "login1.cluster.example", timeout=60, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    done = run_hetlaunch("validate", str(REPO / "cluster_examples" / "slurm.yaml"), timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{REPO / 'cluster_examples' / 'slurm.yaml'}: ok (3 nodes, 1 local, 0 remote, "
                                  "0 over ssh, 2 by slurm)"), done.stdout


def test_the_allocation_asked_for_a_group():
    cfg = parse_cluster(HEAD + """
slurm: [{name: g, partition: gpu, account: lab, gpus_per_node: 2, time: "1-00:00:00", salloc_options: [--qos=high]}]
nodes: [{name: a, launch: slurm, host: gpu-07}, {name: b, launch: slurm}]
""", "c.yaml")
    assert salloc_command([Component(cfg.slurm[0], 0, cfg.nodes)], Path("/r/g"))[4:] == [
        "salloc", "--nodes=2", "--job-name=hetlaunch-g", "--no-kill", "--partition=gpu", "--account=lab",
        "--gpus-per-node=2", "--time=1-00:00:00", "--nodelist=gpu-07", "--qos=high", "--",
        "sh", "-c", ': > "$0"; echo "hetlaunch-allocation $SLURM_JOB_ID $SLURM_JOB_NODELIST"; exec cat >/dev/null',
        "/r/g"]


def test_salloc_runs_under_a_shell_that_withdraws_it_when_stdin_closes(tmp_path):
    """A request still queued has no command holding it: the shell around salloc sends it SIGTERM
    when stdin closes (SIGKILL of `up`); a granted one is given up by its command's end, never by a
    SIGTERM (real salloc ignores it then, and one was left spinning); and the shell ends with
    salloc's own exit code, nothing of it left. A stand-in salloc (a script) plays each part."""
    import subprocess
    import time

    cfg = parse_cluster(HEAD + "slurm: [{name: g}]\nnodes: [{name: a, launch: slurm}]\n", "c.yaml")
    granted = tmp_path / "granted"
    command = salloc_command([Component(cfg.slurm[0], 0, cfg.nodes)], granted)
    assert command[:4] == ["sh", "-c", command[2], str(granted)] and command[4] == "salloc"
    fake = tmp_path / "salloc"
    fake.write_text('#!/bin/sh\ntrap \'echo withdrawn >> "$OUT"; exit 0\' TERM\n'
                    'if [ -n "$REFUSE" ]; then exit 3; fi\n'
                    'if [ -n "$GRANT" ]; then  # run the command in the foreground, as salloc does\n'
                    '  while [ "$1" != "--" ]; do shift; done; shift; "$@"; echo released >> "$OUT"; exit 0\nfi\n'
                    'echo queued >> "$OUT"\nwhile :; do sleep 0.05; done\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "OUT": str(out)}

    def wait_for_line(line: str) -> None:
        deadline = time.monotonic() + 20
        while not (out.exists() and line in out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)

    queued = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, start_new_session=True)  # as up starts it
    wait_for_line("queued")
    time.sleep(1.0)
    assert out.read_text().split() == ["queued"], "withdrawn while stdin was still open"
    queued.stdin.close()  # what SIGKILL of `up` does to the pipe
    assert queued.wait(timeout=20) == 0 and out.read_text().split() == ["queued", "withdrawn"]
    out.unlink()
    running = subprocess.Popen(command, stdin=subprocess.PIPE, env={**env, "GRANT": "1"}, start_new_session=True)
    deadline = time.monotonic() + 20
    while not granted.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert granted.exists(), "the command did not mark the allocation granted"
    running.stdin.close()
    assert running.wait(timeout=20) == 0 and out.read_text().split() == ["released"]  # no SIGTERM sent
    refused = subprocess.Popen(command, stdin=subprocess.PIPE, env={**env, "REFUSE": "1"}, start_new_session=True)
    assert refused.wait(timeout=20) == 3  # salloc's exit seen at once, though stdin stays open

    def left() -> list[str]:
        session = subprocess.run(["ps", "-o", "pid=,stat=", "-s", str(refused.pid)], capture_output=True, text=True)
        return [line.split()[0] for line in session.stdout.splitlines() if not line.split()[1].startswith("Z")]

    # The shell's SIGTERM to its group is on its way when it exits: its watcher ends when scheduled
    # (a fixed 0.5 s was too short once beside a busy loop), while stdin stays open: not by EOF.
    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    remaining = left()
    refused.stdin.close()
    assert not remaining, f"the wrapper left {remaining} behind (the watcher's cat)"


def test_groups_of_one_het_job_are_the_components_of_one_salloc():
    cfg = parse_cluster(HEAD + """
slurm: [{name: a, partition: gpu, het_job: j}, {name: b, gpus_per_node: 1, het_job: j}]
nodes: [{name: x, launch: slurm, slurm: a}, {name: y, launch: slurm, slurm: b}, {name: z, launch: slurm, slurm: b}]
""", "c.yaml")
    a, b = cfg.slurm
    assert salloc_command([Component(a, 0, cfg.nodes[:1]), Component(b, 1, cfg.nodes[1:])], Path("/r/g"))[4:] == [
        "salloc", "--nodes=1", "--job-name=hetlaunch-j", "--no-kill", "--partition=gpu", ":",
        "--nodes=2", "--job-name=hetlaunch-j", "--no-kill", "--gpus-per-node=1", "--",
        "sh", "-c", ': > "$0"; echo "hetlaunch-allocation $SLURM_JOB_ID $SLURM_JOB_NODELIST_HET_GROUP_0 '
                    '$SLURM_JOB_NODELIST_HET_GROUP_1"; exec cat >/dev/null', "/r/g"]


def test_slurm_s_reasons_are_one_line():
    text = ("salloc: error: invalid partition specified: nope\n"
            "salloc: error: Job submit/allocate failed: Invalid partition name specified\n")
    assert salloc_errors(text) == ("invalid partition specified: nope; "
                                   "Job submit/allocate failed: Invalid partition name specified")
    assert salloc_errors("salloc: unrecognized option '--bogus'\nTry \"salloc --help\" for more information\n") == \
        "unrecognized option '--bogus'"
    assert salloc_errors("salloc: Pending job allocation 4\nsalloc: job 4 queued and waiting for resources\n"
                         "salloc: Job allocation 4 has been revoked.\n") == "Job allocation 4 has been revoked."
    assert salloc_errors("") == "salloc exited without a reason"


@pytest.mark.parametrize("text, message", [
    ("nodes: [{name: a, launch: slurm}]",
     "slurm: node a has launch: slurm: add a top-level slurm: list of groups (partition, account, gpus_per_node, time)"),
    ("slurm: [{name: g}]\nnodes: [{name: a, launch: slurm, slurm: h}]",
     "nodes[0].slurm: no slurm group 'h' (groups: g)"),
    ("slurm: [{name: g}, {name: h}]\nnodes: [{name: a, launch: slurm, slurm: h}, {name: b, launch: slurm}]",
     "nodes[1].slurm: required with 2 slurm groups (one of g, h)"),
    ("slurm: [{name: g}, {name: h}]\nnodes: [{name: a, launch: slurm, slurm: h}]",
     "slurm[0].name: no node has launch: slurm in group 'g'"),
    ("slurm: [{name: g}, {name: g}]\nnodes: [{name: a, launch: slurm}]", "slurm[1].name: duplicate group 'g'"),
    ("slurm: [{name: g, srun_options: [qos]}]\nnodes: [{name: a, launch: slurm}]",
     "slurm[0].srun_options: 'qos' is not an option (each item one option, e.g. --qos=high)"),
    ("slurm: [{name: g, srun_options: [--pty]}]\nnodes: [{name: a, launch: slurm}]",
     "slurm[0].srun_options: --pty: a terminal echoes stdin's first line (the join token) into the agent's log"),
    ("slurm: [{name: g, salloc_options: [--no-shell]}]\nnodes: [{name: a, launch: slurm}]",
     "slurm[0].salloc_options: --no-shell: up holds the allocation with salloc's command"),
    ("slurm: [{name: g, time: soon}]\nnodes: [{name: a, launch: slurm}]",
     "slurm[0].time: a Slurm time limit such as 30, 2:00:00 or 1-12:00:00 (got 'soon')"),
    ('slurm: [{name: g, time: "2:00:00\\n"}]\nnodes: [{name: a, launch: slurm}]',  # re.match's $ let it through
     "slurm[0].time: a Slurm time limit such as 30, 2:00:00 or 1-12:00:00 (got '2:00:00\\n')"),
    ("slurm: [{name: g, time: 2:00:00}]\nnodes: [{name: a, launch: slurm}]",
     'slurm[0].time: quote it, e.g. "2:00:00" (YAML read a number, 7200)'),
    ("slurm: [{name: g, partition: 'a b'}]\nnodes: [{name: a, launch: slurm}]", "slurm[0].partition: "),
    ("slurm: [{name: g, gpus_per_node: 0}]\nnodes: [{name: a, launch: slurm}]", "slurm[0].gpus_per_node: "),
    ("slurm: [{name: g, nodes: 3}]\nnodes: [{name: a, launch: slurm}]", "slurm[0].nodes: unknown key (valid: name, "),
    ("slurm: [{name: g}]\nnodes: [{name: a, slurm: g}, {name: b, launch: slurm}]",
     "nodes[0].slurm: only with launch: slurm (this node has launch: local)"),
    ("slurm: [{name: g}]\nnodes: [{name: a, launch: slurm, threads: 2}]", "nodes[0].threads: only for local nodes"),
    # Both agents would have been started on gpu-07 and the allocation's other node left idle.
    ("slurm: [{name: g}]\nnodes: [{name: a, launch: slurm, host: gpu-07}, {name: b, launch: slurm, host: gpu-07}]",
     "nodes[1].host: node a is already pinned to Slurm node gpu-07 (one agent per Slurm node of a group)"),
])
def test_bad_slurm_yaml_is_one_line_naming_the_field(text, message):
    assert error_of(HEAD + text).startswith(f"cluster.yaml: {message}")


def test_two_groups_may_pin_one_slurm_node():
    """Two groups are two allocations; a node that is not exclusive (8 GPUs, 4 for each) may be in both."""
    cfg = parse_cluster(HEAD + """
slurm: [{name: g, gpus_per_node: 4}, {name: h, gpus_per_node: 4}]
nodes: [{name: a, launch: slurm, slurm: g, host: gpu-07}, {name: b, launch: slurm, slurm: h, host: gpu-07}]
""", "c.yaml")
    assert [n.host for n in cfg.nodes] == ["gpu-07", "gpu-07"]
