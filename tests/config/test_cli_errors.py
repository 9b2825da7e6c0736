"""What a user sees when something is wrong: real CLI subprocesses, one-line errors, the right exit codes, no leftovers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
import typer

from conftest import (REPO, hetlaunch_cmd, hetlaunch_env, output, popen_hetlaunch, run_hetlaunch, stop_process,
                      stray_processes, wait_for)

TINY_MODEL = "model: {preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MARKUP = re.compile(r"\[/?[a-z ]*\]")


def error_lines(stderr: str) -> list[str]:
    """Non-empty stderr lines with terminal escapes and rich markup removed."""
    text = MARKUP.sub("", ANSI.sub("", stderr))
    return [line.strip() for line in text.splitlines() if line.strip()]


def no_token_env() -> dict[str, str]:
    env = hetlaunch_env()
    env.pop("HETLAUNCH_TOKEN", None)
    return env


@pytest.mark.timeout(60)
def test_validate_accepts_a_good_example():
    # Every example is loaded in-process by test_cluster_config.py; this is the CLI's side of it.
    result = run_hetlaunch("validate", str(REPO / "cluster_examples" / "tiny_test.yaml"), timeout=45)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout
    assert error_lines(result.stderr) == []


BAD_CONFIGS = {
    "malformed_yaml": ("nodes:\n  - {name: a, device: cpu\n", "not valid YAML"),
    "unknown_key": (f"""{TINY_MODEL}
nodes:
  - {{name: a, device: cpu, threads: 1}}
  - {{name: b, device: cpu, threads: 1}}
  - {{name: c, device: cpu, threads: 1, regoin: us-east}}
""", "nodes[2].regoin"),
    "overlapping_layers": (f"""{TINY_MODEL}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [1, 4]}}
""", "overlaps"),
    "layer_gap": (f"""{TINY_MODEL}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 1]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 4]}}
""", "unassigned"),
    "checkpoints_into_a_device": (f"""{TINY_MODEL}
checkpoint: {{dir: /dev/null}}
nodes: [{{name: a, device: cpu, threads: 1}}]
""", "checkpoint.dir: '/dev/null' exists and is not a directory"),
    "checkpoints_into_the_root": (f"""{TINY_MODEL}
checkpoint: {{dir: /}}
nodes: [{{name: a, device: cpu, threads: 1}}]
""", "checkpoint.dir: '/' is the file system's root"),
    # Path.expanduser raises RuntimeError for a user with no home: a traceback (a hostile review)
    "checkpoints_in_no_users_home": (f"""{TINY_MODEL}
checkpoint: {{dir: "~no-such-user-hl/ck"}}
nodes: [{{name: a, device: cpu, threads: 1}}]
""", "checkpoint.dir: '~no-such-user-hl/ck': '~no-such-user-hl' is no user's home on this host"),
    "data_in_no_users_home": (f"""{TINY_MODEL}
data: {{path: "~no-such-user-hl/x.txt"}}
nodes: [{{name: a, device: cpu, threads: 1}}]
""", "data.path: '~no-such-user-hl/x.txt': '~no-such-user-hl' is no user's home on this host"),
    # a trailing space was called a non-loopback address, and with insecure: true anything passed (a hostile review)
    "coordinator_host_not_an_address": (f"""{TINY_MODEL}
coordinator: {{host: "127.0.0.1 -x", insecure: true}}
nodes: [{{name: a, device: cpu, threads: 1}}]
""", "coordinator.host: must match"),
    "100_local_nodes": (f"{TINY_MODEL}\nnodes:\n" + "".join(f"  - {{name: n{i}, device: cpu}}\n" for i in range(100)),
                          "100 nodes with launch: local, at most 64"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["validate", "up"])
@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_is_one_line_and_exit_2(case, command, tmp_path):
    text, expected = BAD_CONFIGS[case]
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(text)
    run_dir = tmp_path / "run"
    args = [command, str(yaml_path)] + (["--run-dir", str(run_dir)] if command == "up" else [])
    result = run_hetlaunch(*args, timeout=45, cwd=tmp_path)
    assert result.returncode == 2, result.stderr + result.stdout
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert expected in lines[0]
    assert str(yaml_path) in lines[0]  # the message names the file
    assert not run_dir.exists(), "a config error must not leave a run directory behind"
    assert not (tmp_path / "runs").exists()


USAGE_ERRORS = {
    "missing_argument": (("up",), "hetlaunch up: Missing argument 'cluster_yaml'"),
    "unknown_option": (("up", "--bogus", "x.yaml"), "hetlaunch up: No such option: --bogus"),
    "unknown_command": (("nosuch",), "hetlaunch: No such command 'nosuch'"),
    "wrong_type": (("plan", "x.yaml", "--microbatches", "abc"), "hetlaunch plan: Invalid value for '--microbatches'"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_is_one_line_and_exit_2(case, tmp_path):
    # typer's default is a framed box of usage, hint and error over five lines or more.
    args, expected = USAGE_ERRORS[case]
    result = run_hetlaunch(*args, timeout=45, cwd=tmp_path)
    assert result.returncode == 2, result.stderr + result.stdout
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {expected}"), lines[0]
    assert "--help" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(60)
def test_help_still_works_after_usage_errors_became_one_line(tmp_path):
    result = run_hetlaunch("up", "--help", timeout=45, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "cluster_yaml" in result.stdout and "--run-dir" in result.stdout
    bare = run_hetlaunch(timeout=45, cwd=tmp_path)  # no command: the help, as before, exit 2
    assert bare.returncode == 2
    assert "Commands" in bare.stdout and "up" in bare.stdout


@pytest.mark.timeout(90)
def test_node_that_never_joins(tmp_path):
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""{TINY_MODEL}
coordinator: {{join_timeout_s: 3}}
train: {{steps: 2, micro_batch_size: 2, num_microbatches: 2}}
nodes:
  - {{name: here-a, device: cpu, threads: 1}}
  - {{name: here-b, device: cpu, threads: 1}}
  - {{name: far-away, launch: remote, host: far.example.com, device: cpu}}
""")
    start = time.monotonic()
    result = run_hetlaunch("up", str(yaml_path), "--run-dir", str(tmp_path / "run"), timeout=60,
                           env=no_token_env())
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr + result.stdout
    assert elapsed < 30
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert "far-away" in lines[0] and "never joined" in lines[0]
    assert "far.example.com" in lines[0]
    assert stray_processes() == [], "up returned before its local agents were gone"


@pytest.mark.timeout(90)
def test_agent_with_wrong_token_is_refused(tmp_path):
    yaml_path = tmp_path / "cluster.yaml"
    yaml_path.write_text(f"""{TINY_MODEL}
coordinator: {{join_timeout_s: 20}}
nodes:
  - {{name: r0, launch: remote, device: cpu}}
  - {{name: r1, launch: remote, device: cpu}}
""")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml_path), "--run-dir", str(run_dir),
                         env=hetlaunch_env(HETLAUNCH_TOKEN="the-right-token"))
    try:
        contact = run_dir / "coordinator.json"
        wait_for(contact.exists, 30, "coordinator.json", proc=up)
        address = json.loads(contact.read_text())["address"]
        agent = subprocess.run(hetlaunch_cmd("agent", "--coordinator", address, "--name", "r0",
                                             "--connect-timeout", "10"),
                               capture_output=True, text=True, timeout=30,
                               env=hetlaunch_env(HETLAUNCH_TOKEN="wrong"))
        assert agent.returncode == 1, agent.stderr
        assert "UNAUTHENTICATED" in agent.stderr
        assert up.poll() is None, "a refused agent must not end the job: the right one may still come"
    finally:
        stop_process(up)
    assert up.returncode != 0
    assert stray_processes() == []
    _, err = output(up)
    assert "the-right-token" not in err


@pytest.mark.parametrize("seconds", ["0", "nan", "inf", "1e10"])
def test_an_agent_connect_timeout_past_any_use_is_one_line_before_dialing(seconds):
    """1e10 s passed and overflowed a deadline: a traceback (a hostile review)."""
    agent = run_hetlaunch("agent", "--coordinator", "127.0.0.1:9", "--name", "a", "--connect-timeout", seconds,
                          env=hetlaunch_env(HETLAUNCH_TOKEN="t"), timeout=30)
    assert agent.returncode == 2 and agent.stderr.strip().splitlines() == [
        f"error: --connect-timeout must be a positive number of seconds, at most a year (got {float(seconds)})"
    ], agent.stderr


@pytest.mark.parametrize("name", ["a\nb", "-rf", "x" * 65, "a b", ""])
def test_an_agent_name_that_no_yaml_could_give_is_one_line_before_dialing(name):
    """A newline in --name split the agent's error over two lines, after it had dialed."""
    agent = run_hetlaunch("agent", "--coordinator", "127.0.0.1:9", "--name", name, "--connect-timeout", "30",
                          env=hetlaunch_env(HETLAUNCH_TOKEN="t"), timeout=30)
    assert agent.returncode == 2 and agent.stderr.strip().splitlines() == [
        f"error: --name must be 1-64 of letters, digits, '_', '.', '-', starting with a letter or digit (got {name!r})"
    ], agent.stderr


def test_plan_compression_flag_pins_every_boundary_or_is_one_line(tmp_path):
    import random

    from plan_reference import random_profile

    from hetlaunch.launcher.planning.profile_file import save_profile

    rng = random.Random(3)
    save_profile(random_profile(rng, 4, 2, 8), tmp_path / "p.json")
    bad = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--compression", "zip")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --compression must be auto or one of none, fp16, bf16, int8, int4_rotated, int4 (got 'zip')"]
    pinned = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--compression", "int8", "--json",
                           "--max-pipelines", "1", "--stages", "3")
    assert pinned.returncode == 0, pinned.stderr
    stages = json.loads(pinned.stdout)["pipelines"][0]["stages"]
    assert len(stages) > 1 and {s["codec"] for s in stages[:-1]} == {"int8"}


@pytest.mark.parametrize("raised, code, line", [(typer.Abort(), 130, "error: aborted"), (RuntimeError("boom"), None, None)])
def test_main_routes_an_abort_to_one_line_and_lets_other_errors_through(raised, code, line, monkeypatch, capsys):
    """main() named an exception class this typer lacks (click's Abort), so every error it did not
    catch ended in a second traceback, an AttributeError, instead of its own."""
    from hetlaunch.launcher import cli

    def hurt(path):
        raise raised

    monkeypatch.setattr(cli, "load_cluster_file", hurt)
    monkeypatch.setattr(sys, "argv", ["hetlaunch", "validate", "x.yaml"])
    if code is None:
        with pytest.raises(type(raised), match="boom"):
            cli.main()
    else:
        with pytest.raises(SystemExit) as exited:  # main exits with the status, as typer's entry point does
            cli.main()
        assert exited.value.code == code
        assert capsys.readouterr().err.strip() == line


@pytest.mark.parametrize("args", [("report", "{long}"), ("logs", "{long}", "n0"), ("status", "{long}"),
                                  ("validate", "{long}.yaml"), ("report", "{loop}"),
                                  ("up", "{example}", "--run-dir", "{long}"), ("up", "{example}", "--token-file", "{long}")])
def test_a_path_no_file_system_can_open_is_one_line(args, tmp_path):
    """A name of over 255 characters (ENAMETOOLONG) or a loop of links gave a traceback in most
    commands (a hostile review); now one line naming it, exit 2, whichever command met it first."""
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    names = {"long": str(tmp_path / ("x" * 300)), "loop": str(tmp_path / "l1"),
             "example": str(REPO / "cluster_examples" / "tiny_test.yaml")}
    result = run_hetlaunch(*(a.format(**names) for a in args), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert "File name too long" in result.stderr or "l1" in result.stderr, result.stderr


def test_control_characters_in_a_run_dir_or_yaml_name_never_reach_the_terminal(tmp_path):
    """An ESC in --run-dir cleared the screen in "coordinator listening ... (run dir ...)" and
    "metrics in ..."; a newline split them; validate printed its YAML's name raw (a hostile review)."""
    odd = tmp_path / "a\x1b[2J\nb"
    result = run_hetlaunch("up", str(REPO / "cluster_examples" / "tiny_test.yaml"), "--run-dir", str(odd), timeout=60)
    assert result.returncode == 2 and "\x1b" not in result.stdout + result.stderr, result.stderr
    assert result.stderr.splitlines() == [f"error: run directory {tmp_path}/a\\x1b[2J\\x0ab: a name with control "
                                          "characters (a newline, an escape) is refused"], result.stderr
    assert not odd.exists()
    named = tmp_path / "c\x1b[2J.yaml"
    named.write_text((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    result = run_hetlaunch("validate", str(named), timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"{tmp_path}/c\\x1b[2J.yaml: ok"), result.stdout


@pytest.mark.parametrize("args, flag", [(("export", "run", "-o", ""), "-o"), (("report", "run", "-o", ""), "-o"),
                                        (("deploy", "k8s", "c.yaml", "-o", ""), "-o"), (("certs", "init", ""), "DIRECTORY"),
                                        (("prepare-data", "t.txt", "--tokenizer", "t.json", "-o", ""), "-o")])
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(args, flag, tmp_path):
    """Path("") is ".": an empty -o (an unset shell variable) wrote into the current directory (a hostile review)."""
    result = run_hetlaunch(*args, timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == (f"error: {flag}: an empty path (give '.' for the current "
                                                        "directory)\n"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_home_in_an_output_path_is_the_users_home_as_in_the_yaml(monkeypatch, tmp_path):
    """A quoted -o '~/x.bin' was written into a folder named ~ where the command ran, while the YAML
    line prepare-data prints for it names the home's file (a hostile review)."""
    from hetlaunch.launcher.cli_common import given_path

    monkeypatch.setenv("HOME", str(tmp_path))
    assert given_path("~/x.bin", "-o") == tmp_path / "x.bin"
    assert given_path("x.bin", "-o") == type(tmp_path)("x.bin")  # a relative path stays relative
    with pytest.raises(typer.Exit) as caught:
        given_path("~no-such-user-hl/x.bin", "-o")
    assert caught.value.exit_code == 2


def test_an_output_in_no_users_home_is_one_line(tmp_path):
    result = run_hetlaunch("export", "run", "-o", "~no-such-user-hl/x.safetensors", timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == ("error: -o '~no-such-user-hl/x.safetensors': "
                                                        "'~no-such-user-hl' is no user's home on this host\n"), result.stderr
    assert list(tmp_path.iterdir()) == []


def _profile_of(names_regions: list[tuple[str, str]]) -> dict:
    """A saved profile of the default model (the YAML below names none) on these nodes."""
    node = lambda name, region: dict(name=name, region=region, device="cpu", memory_bytes=9e6,  # noqa: E731
                                     layer_seconds=[0.002] * 6)
    regions = sorted({r for _, r in names_regions})
    return {"format": "hetlaunch-profile/1",
            "model": {"description": "gpt(vocab=256,seq=64,d=64,layers=4,heads=4,ff=256)", "num_layers": 6},
            "micro_batch_size": 8, "seq_len": 64,
            "layers": [{"param_bytes": 20000, "activation_bytes": 100000, "output_bytes": 131072}] * 6,
            "nodes": [node(n, r) for n, r in names_regions],
            "links": [{"regions": [a, b], "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-4}
                      for i, a in enumerate(regions) for b in regions[i:]]}


@pytest.mark.timeout(120)
def test_plan_from_a_saved_profile_plans_the_yamls_nodes_only(tmp_path):
    """`plan YAML --profile P` planned stages on P's nodes that the YAML does not have, and said
    nothing of the YAML's node P lacks (a hostile review): it plans on the YAML's nodes, as `up`
    measures them, and refuses a profile without one of them or with one in another region."""
    (tmp_path / "two.yaml").write_text("name: two\nnodes:\n  - {name: east-a, device: cpu}\n"
                                       "  - {name: east-b, device: cpu}\n")
    cases = {"others.json": [("east-a", "default"), ("stranger-1", "default"), ("stranger-2", "default")],
             "moved.json": [("east-a", "default"), ("east-b", "west")],
             "more.json": [("east-a", "default"), ("east-b", "default"), ("stranger-1", "default")]}
    for name, nodes in cases.items():
        (tmp_path / name).write_text(json.dumps(_profile_of(nodes)))
    result = run_hetlaunch("plan", "two.yaml", "--profile", "others.json", timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == ("error: others.json: no node east-b of the YAML; profile this "
                                                        "cluster (hetlaunch profile) or plan without --profile\n"), result
    result = run_hetlaunch("plan", "two.yaml", "--profile", "moved.json", timeout=60, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr == ("error: moved.json: another cluster's profile: its regions "
                                                        "differ for east-b (YAML default, profile west)\n"), result
    result = run_hetlaunch("plan", "two.yaml", "--profile", "more.json", "--json", timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    planned = {s["node"] for p in json.loads(result.stdout)["pipelines"] for s in p["stages"]}
    assert planned and planned <= {"east-a", "east-b"}, planned  # stranger-1 is not the YAML's
