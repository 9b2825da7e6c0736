"""What a hostile user tries against a running job: kill a node mid-step, put markup in the YAML.

Real `hetlaunch up` processes with local agents over gloo; the user must see one line naming
the cause, the documented exit code, no traceback and no process left behind.
"""

from __future__ import annotations

import os
import signal
import stat
import time

import pytest

from conftest import agent_of, hetlaunch_env, popen_hetlaunch, run_hetlaunch, stop_process, stray_processes, wait_for

THREE_NODES = """
model: {preset: tiny, n_layers: 4, seq_len: 16, d_model: 32}
train: {steps: 400, micro_batch_size: 2, num_microbatches: 4}
compression: {intra_region: none, cross_region: none}
nodes:
  - {name: n1, device: cpu, threads: 1, layers: [0, 2]}
  - {name: n2, device: cpu, threads: 1, layers: [2, 4]}
  - {name: n3, device: cpu, threads: 1, layers: [4, 6]}
"""




def metrics_lines(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(180)
def test_killing_the_middle_node_blames_it_not_a_survivor(tmp_path):
    # No restart allowed: the job ends, and the error must name the node that was lost.
    (tmp_path / "cluster.yaml").write_text(THREE_NODES.replace("num_microbatches: 4}", "num_microbatches: 4, max_restarts: 0}"))
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), cwd=tmp_path)
    try:
        wait_for(lambda: metrics_lines(run_dir) >= 3, 120, "three training steps", proc=up)
        victim = agent_of("n2")
        assert victim is not None, "the agent of n2 is not running"
        victim.send_signal(signal.SIGKILL)
        up.wait(timeout=60)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 1, err + out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: lost node n2:"), lines[0]
    assert lines[0].endswith("(no restart left: train.max_restarts is 0)"), lines[0]
    assert "Traceback" not in err and "MarkupError" not in err
    # The survivors' errors come after the cause, as its consequences, never as the cause.
    assert "stage on node n1 failed" not in lines[0] and "stage on node n3 failed" not in lines[0]
    assert stray_processes() == []


@pytest.mark.timeout(60)
def test_markup_in_user_text_is_printed_verbatim(tmp_path):
    (tmp_path / "cluster.yaml").write_text('train: {schedule: "[bold red]1f1b"}\nnodes: [{name: a}]\n')
    result = run_hetlaunch("validate", str(tmp_path / "cluster.yaml"), timeout=45)
    assert result.returncode == 2
    assert "'[bold red]1f1b'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


MARKER_MODEL = '''
import os
with open(os.environ["MARKER_FILE"], "a") as f:
    f.write(f"{os.getpid()}\\n")
from user_model import make_mlp_lm
'''


@pytest.mark.timeout(150)
def test_the_coordinator_never_imports_the_users_model(tmp_path):
    # Only agents build the model; the coordinator learns its depth from their profiles.
    (tmp_path / "marker_model.py").write_text(MARKER_MODEL)
    (tmp_path / "cluster.yaml").write_text("""
model: {entrypoint: "marker_model:make_mlp_lm", kwargs: {seq_len: 16}}
train: {steps: 3, micro_batch_size: 2, num_microbatches: 2, max_pipelines: 1}
nodes:
  - {name: u0, device: cpu, threads: 1}
  - {name: u1, device: cpu, threads: 1}
""")
    markers = tmp_path / "imported_by.txt"
    env = hetlaunch_env(MARKER_FILE=str(markers), HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    up = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "run"), env=env)
    try:
        up.wait(timeout=120)
    finally:
        out, err = stop_process(up)
    assert up.returncode == 0, err + out
    importers = {int(pid) for pid in markers.read_text().split()}
    assert importers and up.pid not in importers


@pytest.mark.timeout(120)
def test_pinned_layers_of_a_user_model_must_reach_its_last_layer(tmp_path):
    # The YAML cannot know an entrypoint's depth; the last stage's agent checks it before training.
    (tmp_path / "cluster.yaml").write_text("""
model: {entrypoint: "user_model:make_mlp_lm", kwargs: {seq_len: 16}}
train: {steps: 3, micro_batch_size: 2, num_microbatches: 2}
compression: {intra_region: none, cross_region: none}
nodes:
  - {name: u0, device: cpu, threads: 1, layers: [0, 2]}
  - {name: u1, device: cpu, threads: 1, layers: [2, 4]}
""")
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "run"), timeout=100)
    assert result.returncode == 1, result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "stage on node u1 failed" in lines[0] and "the model has 5 layers" in lines[0], lines[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where, said", [("missing/dir/p.json", "cannot write"), ("a_file/p.json", "cannot write"),
                                         (".", "names a folder"), ("newdir/", "names a folder"),
                                         ("fifo", "exists and is not a regular file"), ("x" * 300, "File name too long")])
def test_profile_output_that_cannot_be_written_is_refused_before_measuring(tmp_path, where, said):
    # A FIFO (or, as root, /dev/null itself) was replaced by the profile renamed over it; "newdir/"
    # became a file "newdir" (a hostile review).
    (tmp_path / "a_file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: a, device: cpu, threads: 1}]\n")
    started = time.monotonic()
    result = run_hetlaunch("profile", str(tmp_path / "cluster.yaml"), "-o", str(tmp_path) + "/" + where,
                           "--run-dir", str(tmp_path / "run"), timeout=50)
    assert result.returncode == 2, result.stderr + result.stdout
    assert result.stderr.startswith("error: ") and said in result.stderr and len(result.stderr.splitlines()) == 1, \
        result.stderr
    assert time.monotonic() - started < 20 and not (tmp_path / "run").exists()
    assert stat.S_ISFIFO(os.stat(tmp_path / "fifo").st_mode) and not (tmp_path / "newdir").exists()


def test_save_profile_is_whole_or_a_one_line_error(tmp_path):
    from hetlaunch.launcher.planning.profile_file import ProfileError, load_profile, save_profile
    from plan_reference import uniform_profile  # a small profile built in code

    profile = uniform_profile([1.0, 0.5], ["east", "west"])
    save_profile(profile, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ProfileError, match=r"^cannot write .*a_file/p.json: Not a directory$"):
        save_profile(profile, tmp_path / "a_file" / "p.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "p.json"]  # no temporary file left


def test_a_diverged_loss_is_written_as_null_not_nan(tmp_path):
    import json
    import math

    from hetlaunch.launcher.run_record import RunRecord, StepRecord

    record = RunRecord(tmp_path)
    record.add(StepRecord(step=0, loss=math.nan, tokens_per_s=math.inf, step_s=0.1, stages=[]))
    record.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))["loss"] is None


def _profile_text(tmp_path, edit=None) -> str:
    import json

    from hetlaunch.launcher.planning.profile_file import save_profile
    from plan_reference import uniform_profile

    save_profile(uniform_profile([1.0, 0.5], ["east", "west"]), tmp_path / "good.json")
    data = json.loads((tmp_path / "good.json").read_text())
    if edit:
        edit(data)
    return json.dumps(data)


def _set_node(key, value):
    def edit(data):
        data["nodes"][0][key] = value
    return edit


BAD_PROFILES = {
    "negative_time": (lambda t: _profile_text(t, _set_node("layer_seconds", [-0.01] * 8)),
                      "greater than or equal to 0.000000001"),
    "zero_time": (lambda t: _profile_text(t, _set_node("layer_seconds", [0.0] * 8)), "greater than or equal to 0.000000001"),
    # Above zero but too small to divide by: plans crashed (NaN, ZeroDivisionError) or said inf tokens/s.
    "subnormal_time": (lambda t: _profile_text(t, _set_node("layer_seconds", [5e-324] * 8)), "layer_seconds"),
    # 10**400 crashed the global-batch planner (int too large to convert to float); "2.0" was taken as 2.
    "huge_size_key": (lambda t: _profile_text(t, _set_node("layer_seconds_by_size", {str(10**400): [0.01] * 8})),
                      "must be written as digits"),
    "size_key_not_digits": (lambda t: _profile_text(t, _set_node("layer_seconds_by_size", {"2.0": [0.01] * 8})),
                            "must be written as digits"),
    "size_key_too_big": (lambda t: _profile_text(t, _set_node("layer_seconds_by_size", {str(2**21): [0.01] * 8})),
                         "layer_seconds_by_size"),
    "negative_optimizer": (lambda t: _profile_text(t, _set_node("optimizer_seconds", [-1.0] * 8)), "optimizer_seconds"),
    "negative_codec_cost": (lambda t: _profile_text(t, _set_node("codec_seconds_per_byte", {"int8": -1.0})),
                            "codec_seconds_per_byte"),
    "unknown_codec": (lambda t: _profile_text(t, _set_node("codec_seconds_per_byte", {"int-8": 1e-9})), "is not a codec"),
    "nan": (lambda t: _profile_text(t).replace("0.01", "NaN", 1), "NaN is not a JSON number"),
    "huge_number": (lambda t: _profile_text(t).replace("0.01", "1e400", 1), "finite"),
    "5000_digits": (lambda t: _profile_text(t).replace('"micro_batch_size": 4', '"micro_batch_size": ' + "9" * 5000),
                    "too many digits"),
    "deep_nesting": (lambda t: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "not_utf8": (lambda t: b"\xff\xfe{}", "not UTF-8"),
    # Priced a step at a 300-digit number of ms (1e-300), or said no cut fit in memory (5e-324: inf).
    "vanishing_bandwidth": (lambda t: _profile_text(t, lambda d: [link.update(bandwidth_bytes_per_s=1e-300)
                                                                  for link in d["links"]]), "bandwidth_bytes_per_s"),
    # 2**62 predicted 6e22 tokens/s.
    "huge_micro_batch": (lambda t: _profile_text(t, lambda d: d.update(micro_batch_size=2 ** 62)), "micro_batch_size"),
    "huge_seq_len": (lambda t: _profile_text(t, lambda d: d.update(seq_len=2 ** 62)), "seq_len"),
    # Lax parsing took these as numbers; no measurement writes them, a hand-edited file may mean otherwise.
    "string_seconds": (lambda t: _profile_text(t, _set_node("layer_seconds", ["0.1"] * 8)), "must be a JSON number"),
    "bool_memory": (lambda t: _profile_text(t, _set_node("memory_bytes", True)), "must be a JSON number"),
    "string_count": (lambda t: _profile_text(t, lambda d: d.update(micro_batch_size="4")), "must be a JSON number"),
    # json kept the last of two equal keys: the file meant one thing to its writer, another here.
    "duplicate_key": (lambda t: _profile_text(t).replace('"seq_len": 64', '"seq_len": 64, "seq_len": 9', 1),
                      "'seq_len' appears twice"),
    "self_link": (lambda t: _profile_text(t, lambda d: d["links"].append(
        {"nodes": ["n0", "n0"], "bandwidth_bytes_per_s": 1e9, "latency_s": 0.0})), "joins node n0 to itself"),
    "unknown_region": (lambda t: _profile_text(t, lambda d: d["links"].append(
        {"regions": ["east", "mars"], "bandwidth_bytes_per_s": 1e9, "latency_s": 0.0})), "no node is in region mars"),
    # Valid on its own, but no link joins the two regions: planning found that and exited 1, not 2.
    "missing_link": (lambda t: _profile_text(t, lambda d: d.update(links=[link for link in d["links"]
                                                                          if link["regions"][0] == link["regions"][1]])),
                     "has no link between"),
    "link_twice": (lambda t: _profile_text(t, lambda d: d["links"].append(
        {"regions": ["west", "east"], "bandwidth_bytes_per_s": 1e3, "latency_s": 0.0})), "are given twice"),
    # A key that is a terminal's escape sequence (retitle the window, clear the screen): escaped.
    "escape_sequence_key": (lambda t: _profile_text(t, lambda d: d.update({"\x1b]0;owned\x07\x1b[2J": 1})),
                            "\\x1b]0;owned\\x07\\x1b[2J"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(BAD_PROFILES))
def test_a_hostile_profile_file_is_one_line_exit_2(tmp_path, kind):
    make, reason = BAD_PROFILES[kind]
    content = make(tmp_path)
    path = tmp_path / "bad.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run_hetlaunch("plan", "--profile", str(path), timeout=50)
    assert result.returncode == 2, result.stderr + result.stdout
    assert result.stderr.startswith(f"error: {path}: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert reason in result.stderr and "\x1b" not in result.stderr


@pytest.mark.timeout(60)
def test_a_profile_that_is_not_a_regular_file_never_blocks(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero", tmp_path):
        result = run_hetlaunch("plan", "--profile", str(path), timeout=30)
        assert result.returncode == 2 and "not a regular file" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_a_coordinator_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        (tmp_path / "cluster.yaml").write_text(f"coordinator: {{port: {port}}}\nnodes: [{{name: a, device: cpu}}]\n")
        result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "run"), timeout=50)
    assert result.returncode == 1, result.stderr + result.stdout
    assert result.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}"), result.stderr
    assert len(result.stderr.splitlines()) == 1 and stray_processes() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content,reason", [(None, "is a directory"), (b"", "is empty"),
                                            (b"\xff\xfe token", "printable ASCII"), ("tökén".encode(), "printable ASCII"),
                                            (b"has space\n", "printable ASCII"),
                                            ("fifo", "not a regular file")])  # was "does not exist"
def test_a_bad_token_file_is_named_in_one_line(tmp_path, content, reason):
    path = tmp_path / "token"
    if content is None:
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    result = run_hetlaunch("agent", "--coordinator", "127.0.0.1:1", "--name", "a", "--token-file", str(path),
                           timeout=50)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"error: token file {path}") and reason in result.stderr, result.stderr


@pytest.mark.timeout(30)
def test_validate_never_hangs_on_a_fifo(tmp_path):
    fifo = tmp_path / "cluster.yaml"
    os.mkfifo(fifo)
    result = run_hetlaunch("validate", str(fifo), timeout=20)
    assert result.returncode == 2 and "file is empty" in result.stderr, result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--coordinator", "notaport"], ["--coordinator", "[::1]:x"],
                                  ["--coordinator", "127.0.0.1:99999"], ["--coordinator", "http://127.0.0.1:80"],
                                  ["--coordinator", "127.0.0.1:1", "--connect-timeout", "nan"],
                                  ["--coordinator", "127.0.0.1:1", "--connect-timeout", "-1"]])
def test_agent_arguments_are_checked_at_once(args):
    started = time.monotonic()
    result = run_hetlaunch("agent", "--name", "n0", *args, timeout=50, env=hetlaunch_env(HETLAUNCH_TOKEN="abc"))
    assert result.returncode == 2 and result.stderr.startswith("error: --"), result.stderr
    assert time.monotonic() - started < 20


def test_profile_node_names_follow_the_yaml_rules(tmp_path):
    # A hand-written profile's names reach tables and messages: no escape bytes, newlines or empty names.
    for bad in ["", "x\u001b[31m", "a\nb", "-rf", "n" * 65]:
        text = _profile_text(tmp_path, _set_node("name", bad))
        (tmp_path / "bad.json").write_text(text)
        from hetlaunch.launcher.planning.profile_file import ProfileError, load_profile

        with pytest.raises(ProfileError, match="nodes.0.name"):
            load_profile(tmp_path / "bad.json")


def test_a_profiles_bounds_are_the_yamls():
    """The planner imports no config, so the profile keeps its own copy of the YAML's bounds."""
    from hetlaunch.launcher.config_types import MAX_COUNT, MAX_MODEL_DIM
    from hetlaunch.launcher.planning.profile_file import MAX_MICRO_BATCH, MAX_SEQ_LEN

    assert (MAX_MICRO_BATCH, MAX_SEQ_LEN) == (MAX_COUNT, MAX_MODEL_DIM)
