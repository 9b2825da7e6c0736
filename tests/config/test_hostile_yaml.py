"""Hostile cluster YAML: every case is refused fast, as one line on stderr and exit code 2, never a traceback.

Billion laughs (anchors and aliases), 100,000-deep nesting, a 50 MB file, names that are too long or look like
command-line options, and a data.path that is missing or not a regular file.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from conftest import error_of, run_hetlaunch
from hetlaunch.launcher import cluster_yaml
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.cluster_yaml import cluster_from_dict, load_cluster, parse_cluster

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MARKUP = re.compile(r"\[/?[a-z ]*\]")  # the CLI may print through rich markup or as plain text


def billion_laughs() -> str:
    """About 330 bytes; expanded, 9**9 (387 million) scalars."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    return "\n".join(lines + ["nodes: [{name: n0}]"]) + "\n"


def validate(path: Path, cwd: Path | None = None) -> tuple[str, float]:
    """Run `hetlaunch validate path`; check exit code 2 and one clean stderr line; return (that line, seconds)."""
    start = time.monotonic()
    result = run_hetlaunch("validate", str(path), timeout=60, cwd=cwd)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr + result.stdout
    assert "Traceback" not in result.stderr and "Error:" not in result.stderr.replace("error:", ""), result.stderr
    text = MARKUP.sub("", ANSI.sub("", result.stderr))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert str(path) in lines[0], lines[0]  # names the file
    return lines[0], elapsed


# ------------------------------------------------------------------ through the real CLI


@pytest.mark.timeout(60)
def test_cli_billion_laughs_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size < 400
    line, elapsed = validate(path)
    assert "YAML anchors and aliases are not supported (anchor &a at line 1, column 4)" in line
    assert elapsed < 10, f"validate took {elapsed:.1f}s"  # before: minutes (the whole command, interpreter start included)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nesting, column", [("[" * 100_000 + "]" * 100_000, 67),  # "x: " then the 64th "["
                                             ("{a: " * 100_000 + "1" + "}" * 100_000, 256)])
def test_cli_deep_nesting_is_one_line(tmp_path: Path, nesting: str, column: int) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(f"nodes: [{{name: n0}}]\nx: {nesting}\n")
    line, _ = validate(path)
    assert line.endswith(f"{path}: lists and mappings nested more than 64 levels deep (line 2, column {column})"), line


@pytest.mark.timeout(60)
def test_cli_50_mb_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    with open(path, "w") as f:
        f.write("nodes: [{name: n0}]\n")
        comment = "#" + "x" * 1022 + "\n"
        f.write(comment * (50 * 1024))
    assert path.stat().st_size == 50 * 2**20 + 20
    line, elapsed = validate(path)
    assert line.endswith(f"{path}: file is 50.0 MiB; a cluster YAML is at most 1 MiB"), line
    assert elapsed < 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, message", [
    (f"nodes: [{{name: {'n' * 300}}}]", "nodes[0].name: must be at most 64 characters (got 300)"),
    ("nodes: [{name: n0}, {name: -rf}]", "nodes[1].name: must start with a letter or digit (got '-rf')"),
    ("nodes: [{name: --parent-pid}]", "nodes[0].name: must start with a letter or digit (got '--parent-pid')"),
    (f"nodes: [{{name: n0, region: {'r' * 65}}}]", "nodes[0].region: must be at most 64 characters (got 65)"),
    ("nodes: [{name: n0, region: -east}]", "nodes[0].region: must start with a letter or digit (got '-east')"),
    ("regions: [{name: --x}]\nnodes: [{name: n0}]", "regions[0].name: must start with a letter or digit (got '--x')"),
    (f"name: {'j' * 65}\nnodes: [{{name: n0}}]", "name: must be at most 64 characters (got 65)"),
    ("name: -job\nnodes: [{name: n0}]", "name: must start with a letter or digit (got '-job')"),
], ids=["long-node", "rf", "parent-pid", "long-region", "dash-region", "dash-listed-region", "long-cluster",
        "dash-cluster"])
def test_cli_bad_names(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "names.yaml"
    path.write_text(text + "\n")
    line, _ = validate(path)
    assert line.endswith(f"{path}: {message}"), line


@pytest.mark.timeout(60)
def test_cli_data_path_missing_is_found_by_validate(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("data: {path: corpus.txt}\nnodes: [{name: n0}]\n")
    line, _ = validate(path, cwd=tmp_path)
    # relative to the current directory, as `hetlaunch up` resolves it
    assert line.endswith(f"{path}: data.path: no such file: corpus.txt (in {os.path.realpath(tmp_path)})") or \
        line.endswith(f"{path}: data.path: no such file: corpus.txt (in {tmp_path})"), line
    (tmp_path / "corpus.txt").write_text("some text to train on\n" * 10)  # seq_len 64 + 2 bytes at least
    ok = run_hetlaunch("validate", str(path), timeout=60, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "ok (1 nodes" in ok.stdout


@pytest.mark.timeout(60)
def test_cli_data_path_directory_is_not_a_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"data: {{path: '{tmp_path}'}}\nnodes: [{{name: n0}}]\n")
    line, _ = validate(path)
    assert line.endswith(f"{path}: data.path: not a regular file: {tmp_path}"), line


# ------------------------------------------------------------------ anchors and aliases


def test_billion_laughs_in_process_well_under_a_second() -> None:
    start = time.perf_counter()
    msg = error_of(billion_laughs())
    assert time.perf_counter() - start < 0.5
    assert msg == ("cluster.yaml: YAML anchors and aliases are not supported (anchor &a at line 1, column 4); "
                   "write the value out in full")


@pytest.mark.parametrize("text, what", [
    ("nodes: [&n {name: n0}]", "anchor &n at line 1, column 9"),  # an anchor alone, never used
    ("nodes: [{name: n0}]\nx: *nowhere", "alias *nowhere at line 2, column 4"),  # an alias of nothing
    ("base: &b {device: cpu}\nnodes: [{<<: *b, name: n0}]", "anchor &b at line 1, column 7"),  # a merge key
    ("nodes:\n  - name: n0\n    device: &d cpu\n  - name: n1\n    device: *d\n", "anchor &d at line 3, column 13"),
])
def test_any_anchor_or_alias_is_refused(text: str, what: str) -> None:
    assert error_of(text) == f"cluster.yaml: YAML anchors and aliases are not supported ({what}); write the value out in full"


def test_anchor_like_text_in_quotes_is_fine() -> None:
    cfg = parse_cluster("model: {entrypoint: 'a:b', kwargs: {seq_len: 8, tag: '&a *b'}}\nnodes: [{name: n0}]")
    assert cfg.model.kwargs["tag"] == "&a *b"


# ------------------------------------------------------------------ nesting, size, node count


def kwargs_nested(levels: int) -> str:
    # mapping (1) > model (2) > kwargs (3) > `levels` lists
    return (f"model: {{entrypoint: 'm:f', kwargs: {{seq_len: 8, x: {'[' * levels}{']' * levels}}}}}\n"
            "nodes: [{name: n0}]")


def test_nesting_64_deep_is_allowed_65_is_not() -> None:
    cfg = parse_cluster(kwargs_nested(61))
    inner = cfg.model.kwargs["x"]
    for _ in range(60):
        inner = inner[0]
    assert inner == []
    assert error_of(kwargs_nested(62)) == \
        "cluster.yaml: lists and mappings nested more than 64 levels deep (line 1, column 113)"  # the 62nd "["


def test_deep_block_nesting() -> None:
    text = "".join(" " * i + "a:\n" for i in range(200))
    assert error_of(text) == "cluster.yaml: lists and mappings nested more than 64 levels deep (line 65, column 65)"


@pytest.mark.timeout(30)
def test_a_megabyte_of_brackets_is_refused_quickly() -> None:
    start = time.perf_counter()
    assert "nested more than 64 levels deep" in error_of("[" * (2**20))
    assert time.perf_counter() - start < 5


def test_recursion_error_is_a_last_resort_one_liner(monkeypatch: pytest.MonkeyPatch) -> None:
    def recurse(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(cluster_yaml, "cluster_from_dict", recurse)
    assert error_of("nodes: [{name: n0}]") == "cluster.yaml: nested too deeply to read"


def test_node_count_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_yaml, "MAX_NODES", 100)
    items = ", ".join(["1"] * 200)
    assert error_of(f"x: [{items}]\nnodes: [{{name: n0}}]") == \
        "cluster.yaml: more than 100 YAML keys and values (line 1, column 296); a cluster YAML has a few hundred"
    assert cluster_yaml.MAX_NODES == 100
    monkeypatch.undo()
    assert cluster_yaml.MAX_NODES == 50_000
    parse_cluster(f"model: {{entrypoint: 'm:f', kwargs: {{seq_len: 8, x: [{items}]}}}}\nnodes: [{{name: n0}}]")


def test_file_of_exactly_1_mib_loads_one_byte_more_does_not(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    head = "nodes: [{name: n0}]\n#"
    path.write_text(head + "x" * (2**20 - len(head) - 1) + "\n")
    assert path.stat().st_size == 2**20
    assert load_cluster(path).nodes[0].name == "n0"
    with open(path, "a") as f:
        f.write("\n")
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert str(info.value) == f"{path}: file is 1,048,577 bytes; a cluster YAML is at most 1 MiB"


@pytest.mark.timeout(30)
def test_endless_file_without_a_size_is_read_only_to_the_cap() -> None:
    # /dev/zero reports size 0 and never ends: reading it whole would never return
    with pytest.raises(ConfigError) as info:
        load_cluster("/dev/zero")
    assert str(info.value) == "/dev/zero: more than 1 MiB; a cluster YAML is at most 1 MiB"


def test_parse_cluster_caps_text_too() -> None:
    assert error_of("#" * (2 * 2**20)) == "cluster.yaml: file is 2.0 MiB; a cluster YAML is at most 1 MiB"


# ------------------------------------------------------------------ values PyYAML cannot construct


def test_integer_too_long_for_python() -> None:
    msg = error_of("train: {steps: " + "1" * 5000 + "}\nnodes: [{name: n0}]")
    assert msg == ("cluster.yaml: not valid YAML: Exceeds the limit (4300 digits) for integer string conversion: "
                   "value has 5000 digits")


def test_impossible_date() -> None:
    assert error_of("name: 2024-13-45\nnodes: [{name: n0}]") == "cluster.yaml: not valid YAML: month must be in 1..12"


def test_key_with_newline_or_huge_key_keeps_the_message_short_and_on_one_line() -> None:
    assert error_of('nodes: [{name: n0, "x\\ny": 1}]').startswith("cluster.yaml: nodes[0].'x\\ny': unknown key")
    msg = error_of(f'nodes: [{{name: n0, "{"k" * 1000}": 1}}]')
    assert msg.startswith(f"cluster.yaml: nodes[0].{'k' * 57}...: unknown key"), msg
    assert len(msg) < 300


# ------------------------------------------------------------------ names


@pytest.mark.parametrize("name", ["n", "0", "a" * 64, "gpu-1.us_east", "A100-1", "9x"])
def test_good_names(name: str) -> None:
    cfg = parse_cluster(f"nodes: [{{name: '{name}', region: '{name}'}}]\nregions: [{{name: '{name}'}}]")
    assert cfg.nodes[0].name == cfg.nodes[0].region == cfg.regions[0].name == name


@pytest.mark.parametrize("name", ["job", "0", "j" * 64, "my-run_2"])
def test_good_cluster_names(name: str) -> None:
    assert parse_cluster(f"name: '{name}'\nnodes: [{{name: n0}}]").name == name


@pytest.mark.parametrize("name, message", [
    ("a" * 65, "must be at most 64 characters (got 65)"),
    ("-rf", "must start with a letter or digit (got '-rf')"),
    ("_x", "must start with a letter or digit (got '_x')"),
    (".hidden", "must start with a letter or digit (got '.hidden')"),
    ("..", "must start with a letter or digit (got '..')"),
    ("a/b", "must match [A-Za-z0-9_.-]+ (got 'a/b')"),
    ("", "must match [A-Za-z0-9_.-]+ (got '')"),
])
def test_bad_node_and_region_names(name: str, message: str) -> None:
    assert error_of(f"nodes: [{{name: '{name}'}}]") == f"cluster.yaml: nodes[0].name: {message}"
    assert error_of(f"nodes: [{{name: n0, region: '{name}'}}]") == f"cluster.yaml: nodes[0].region: {message}"
    assert error_of(f"regions: [{{name: '{name}'}}]\nnodes: [{{name: n0}}]") == f"cluster.yaml: regions[0].name: {message}"


@pytest.mark.parametrize("name, message", [
    ("j" * 65, "must be at most 64 characters (got 65)"),
    ("-x", "must start with a letter or digit (got '-x')"),
    ("_x", "must start with a letter or digit (got '_x')"),
    ("Upper", "must match [a-z0-9_-]+ (got 'Upper')"),
])
def test_bad_cluster_names(name: str, message: str) -> None:
    assert error_of(f"name: '{name}'\nnodes: [{{name: n0}}]") == f"cluster.yaml: name: {message}"


def test_names_checked_in_cluster_from_dict_too() -> None:
    with pytest.raises(ConfigError, match=r"^<dict>: nodes\[0\]\.name: must start with a letter or digit"):
        cluster_from_dict({"nodes": [{"name": "--parent-pid"}]})


# ------------------------------------------------------------------ data.path


def test_data_path_missing_relative_to_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    text = "data: {path: corpus.txt}\nnodes: [{name: n0}]"
    assert error_of(text) == f"cluster.yaml: data.path: no such file: corpus.txt (in {os.getcwd()})"
    (tmp_path / "corpus.txt").write_text("hello\n")
    assert parse_cluster(text).data.path == "corpus.txt"  # kept as written; `up` resolves it


def test_data_path_absolute(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    assert error_of(f"data: {{path: '{missing}'}}\nnodes: [{{name: n0}}]") == \
        f"cluster.yaml: data.path: no such file: {missing}"
    real = tmp_path / "corpus.txt"
    real.write_text("hello\n")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    assert parse_cluster(f"data: {{path: '{link}'}}\nnodes: [{{name: n0}}]").data.path == str(link)


@pytest.mark.parametrize("target", ["dir", "/dev/null", "fifo"])
def test_data_path_not_a_regular_file(tmp_path: Path, target: str) -> None:
    if target == "dir":
        path = str(tmp_path)
    elif target == "fifo":
        path = str(tmp_path / "pipe")
        os.mkfifo(path)
    else:
        path = target
    assert error_of(f"data: {{path: '{path}'}}\nnodes: [{{name: n0}}]") == \
        f"cluster.yaml: data.path: not a regular file: {path}"


def test_data_path_empty_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert error_of(f"data: {{path: '{empty}'}}\nnodes: [{{name: n0}}]") == \
        f"cluster.yaml: data.path: file is empty: {empty}"


def test_data_path_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("x\n")
    secret.chmod(0)
    if os.geteuid() == 0:  # root reads any file (CI runs as root): let the OS answer as it would for a user
        real_access = os.access
        monkeypatch.setattr(cluster_yaml.os, "access", lambda p, mode: False if Path(p) == secret else real_access(p, mode))
    assert error_of(f"data: {{path: '{secret}'}}\nnodes: [{{name: n0}}]") == \
        f"cluster.yaml: data.path: not readable: {secret}"


def test_data_path_with_nul_byte() -> None:
    assert error_of('data: {path: "a\\0b"}\nnodes: [{name: n0}]') == \
        "cluster.yaml: data.path: cannot use 'a\\x00b': embedded null byte"


def test_cluster_from_dict_does_not_look_at_the_file_system() -> None:
    # code and tests that build configs may name a file that only exists where the job runs
    cfg = cluster_from_dict({"data": {"path": "/nowhere/corpus.txt"}, "nodes": [{"name": "n0"}]})
    assert cfg.data.path == "/nowhere/corpus.txt"


@pytest.mark.parametrize("text, message", [
    # each past a protocol field's range: `validate` passed them and `up` ended in a traceback
    ("nodes: [{name: a, threads: 100000000000000000000}]", "nodes[0].threads: must be <= 4096"),
    ("train: {eval_every: 4294967296}\nnodes: [{name: a}]", "train.eval_every: must be <= 1000000000"),
    ("train: {steps: 4294967296}\nnodes: [{name: a}]", "train.steps: must be <= 1000000000"),
    ("train: {seed: 9223372036854775808}\nnodes: [{name: a}]", "train.seed: must be <= 9223372036854775807"),
    ("observe: {trace_every: 4294967296}\nnodes: [{name: a}]", "observe.trace_every: must be <= 1000000000"),
    ("nodes: [{name: a, emulate: {speed_changes: [{at_step: 4294967296, speed: 0.5}]}}]",
     "nodes[0].emulate.speed_changes[0].at_step: must be <= 1000000000"),
    # ... or sizing what the planner or the model would allocate
    ("model: {d_model: 100000000}\nnodes: [{name: a}]", "model.d_model: must be <= 16777216"),
    ("train: {num_microbatches: 1000000}\nnodes: [{name: a}]", "train.num_microbatches: must be <= 16384"),
    ("train: {global_batch: 16777216, micro_batch_size: 8}\nnodes: [{name: a}]",
     "train.global_batch: 16777216 samples at micro_batch_size 8 (the largest the planner tries) are more than "
     "the 16,384 micro-batches a step may have"),
    ("train: {watchdog_s: 1.0e+300}\nnodes: [{name: a}]", "train.watchdog_s: must be auto, off or a number of seconds "
                                                            "from 5 to 10,000,000"),
])
def test_numbers_past_what_the_job_can_carry_are_one_line(text: str, message: str) -> None:
    assert message in error_of(text)


def test_the_planner_refuses_more_micro_batches_than_a_step_may_have() -> None:
    """Planning 100,000 micro-batches took 32 s and 16 million ran out of memory (a hostile review)."""
    import random
    import sys

    from conftest import REPO
    from hetlaunch.launcher.planning.planner import PlanningError, plan, plan_global_batch

    sys.path.insert(0, str(REPO / "tests"))
    from plan_reference import random_profile

    profile = random_profile(random.Random(0), 3, 1, 4)
    with pytest.raises(PlanningError, match=r"^1000000 micro-batches per step: from 1 to 16,384$"):
        plan(profile, 1_000_000)
    with pytest.raises(PlanningError, match=r"^a global batch of 16777216 at micro-batch sizes up to \d+ .* more than "
                                            r"the 16,384 micro-batches a step may have$"):
        plan_global_batch(profile, 1 << 24)


@pytest.mark.parametrize("text, message", [
    ("nodes: [{nme: a}]", "nodes[0].nme: unknown key (did you mean 'name'?)"),
    ("slurm: [{nmae: g}]\nnodes: [{name: a, launch: slurm}]", "slurm[0].nmae: unknown key (did you mean 'name'?)"),
])
def test_a_misspelled_required_key_is_said_as_the_misspelling(text: str, message: str) -> None:
    """It was said as the required key missing, the typo that caused it hidden in "(+1 more)"."""
    assert message in error_of(text)


# ------------------------------------------------------------------ coordinator.tls files


@pytest.mark.timeout(90)
def test_validate_reads_every_tls_file_it_names(tmp_path: Path) -> None:
    """`up` read coordinator.tls's files only when it started the coordinator; validate said ok to
    a YAML naming files that were not there (a hostile review). Relative names from the current
    directory, as `up` reads them."""
    from hetlaunch.launcher.certs import init_certs

    init_certs(tmp_path / "certs", ["127.0.0.1"])
    good = ("coordinator: {tls: {cert: certs/coordinator.pem, key: certs/coordinator.key, ca: certs/ca.pem, "
            "agent_cert: certs/agent.pem, agent_key: certs/agent.key}}\nnodes: [{name: n0}]\n")
    path = tmp_path / "c.yaml"
    path.write_text(good)
    ok = run_hetlaunch("validate", str(path), timeout=60, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    path.write_text(good.replace("certs/ca.pem", "certs/missing.pem"))
    line, _ = validate(path, cwd=tmp_path)
    assert line.endswith(f"{path}: coordinator.tls.ca certs/missing.pem: no such file "
                         "(make them with `hetlaunch certs init DIR`)"), line
    (tmp_path / "certs" / "agent.key").write_text("not a key\n")
    path.write_text(good)
    line, _ = validate(path, cwd=tmp_path)
    assert line.endswith(f"{path}: coordinator.tls.agent_key certs/agent.key: not a PEM file"), line
    path.write_text(good.replace("certs/coordinator.pem", "certs"))  # a folder
    line, _ = validate(path, cwd=tmp_path)
    assert f"{path}: coordinator.tls.cert certs: " in line, line
