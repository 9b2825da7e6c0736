"""Files hetlaunch reads back or writes while it runs, made hostile: profile cache entries that
are not what we wrote, run directories that cannot be created, a disk that fills mid-run.

Real processes for what concerns `profile` and `up` (a 1-node cluster of a tiny model, its
profile cache in tmp); in-process unit tests for the validator and the file writers.
The full-disk cases mount a small tmpfs (the tests run as root); they skip only where the
mount is refused with EPERM.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from pathlib import Path

import pytest

from conftest import hetlaunch_env, run_hetlaunch
from small_disk import fill, small_tmpfs
from hetlaunch.launcher.profile_cache import (MAX_ENTRY_BYTES, BadCacheEntry, cached_node, check_entry, node_cache_key,
                                              read_entry, store_node)
from hetlaunch.launcher.run_dir_lock import LOCK_NAME
from hetlaunch.launcher.run_record import RunRecord, StepRecord, make_run_dir, write_run_file
from hetlaunch.launcher.job_errors import BadInputError, JobError
from hetlaunch.runtime.registry import CODEC_NAMES

NUM_LAYERS = 4  # n_layers 2: embedding, 2 blocks, head
CLUSTER = """
name: hostile
model: {preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}
train: {micro_batch_size: 2, num_microbatches: 2, steps: STEPS}
nodes:
  - {name: a, device: cpu, threads: 1}
"""
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def cluster_yaml(directory: Path, steps: int = 3, checkpoint_every: int = 50) -> Path:
    path = directory / f"cluster{steps}-{checkpoint_every}.yaml"
    path.write_text(CLUSTER.replace("STEPS", f"{steps}, checkpoint_every: {checkpoint_every}"))
    return path


def lines(text: str) -> list[str]:
    return [line.strip() for line in ANSI.sub("", text).splitlines() if line.strip()]


def the_error_line(stderr: str) -> str:
    """The CLI's one error line (its markup is being changed elsewhere: only substrings are checked)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in lines(stderr) if "error" in line.lower()]
    assert len(errors) == 1, stderr
    return errors[0]


# --- the profile cache, through real `hetlaunch profile` and `up` runs ---


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """One profile run fills the cache; its one file is the entry the cases below corrupt."""
    tmp = tmp_path_factory.mktemp("hostile-cache")
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp / "cache"))
    first = run_hetlaunch("profile", str(cluster_yaml(tmp)), "-o", str(tmp / "p0.json"), "--run-dir", str(tmp / "r0"),
                          env=env, timeout=120)
    assert first.returncode == 0, first.stderr + first.stdout
    files = list((tmp / "cache" / "profiles").iterdir())
    assert len(files) == 1, files
    good = json.loads(files[0].read_text())
    read_entry(files[0], NUM_LAYERS)  # what we write passes what we read
    return tmp, env, files[0], good


def _with_literal(good: dict, path: tuple, literal: str) -> str:
    """The good entry as JSON text with the value at `path` replaced by a raw JSON literal."""
    entry = json.loads(json.dumps(good))
    target = entry
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = "@@HOSTILE@@"
    return json.dumps(entry).replace('"@@HOSTILE@@"', literal)


BAD_ENTRIES = {
    "empty_list": lambda good: "[]",
    "float_overflow_1e400": lambda good: _with_literal(good, ("layer_seconds", 0), "1e400"),
    "5000_digit_int": lambda good: _with_literal(good, ("layers", 0, "param_bytes"), "9" * 5000),
    "nan": lambda good: _with_literal(good, ("layer_seconds", 1), "NaN"),
    "negative_time": lambda good: _with_literal(good, ("optimizer_seconds", 2), "-0.25"),
}


def _profile_replaces(populated, bad_text: str, name: str) -> tuple[str, dict]:
    tmp, env, path, good = populated
    path.write_text(bad_text)
    result = run_hetlaunch("profile", str(cluster_yaml(tmp)), "-o", str(tmp / f"{name}.json"),
                           "--run-dir", str(tmp / f"run-{name}"), env=env, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    said = ANSI.sub("", result.stdout + result.stderr)
    warnings = [line for line in said.splitlines() if str(path) in line]
    assert len(warnings) == 1 and "warning" in warnings[0], said
    assert "Traceback" not in said, said
    fresh = read_entry(path, NUM_LAYERS)  # replaced by a valid entry
    assert path.read_text() != bad_text
    return said, fresh


@pytest.mark.timeout(150)
@pytest.mark.parametrize("kind", sorted(set(BAD_ENTRIES) - {"negative_time"}))
def test_bad_cache_entry_is_reported_and_remeasured(populated, kind):
    tmp, env, path, good = populated
    _, fresh = _profile_replaces(populated, BAD_ENTRIES[kind](good), kind)
    profile = json.loads((tmp / f"{kind}.json").read_text())
    assert profile["nodes"][0]["layer_seconds"] == fresh["layer_seconds"]  # the profile uses the new measurement


@pytest.mark.timeout(200)
def test_a_plan_the_cached_sizes_forbid_says_where_they_came_from(populated):
    """A cache entry of valid form but absurd sizes (8 PiB a layer) failed every `up` alike with
    'needs about 128 PiB', never naming the cache, never measuring again."""
    tmp, env, path, good = populated
    entry = json.loads(json.dumps(good))
    for layer in entry["layers"]:
        layer["param_bytes"] = 2 ** 53
    path.write_text(json.dumps(entry))
    try:
        result = run_hetlaunch("up", str(cluster_yaml(tmp)), "--run-dir", str(tmp / "up-huge"), env=env, timeout=150)
        assert result.returncode != 0
        line = the_error_line(result.stderr)
        assert "does not fit" in line and "came from the profile cache: `up --reprofile` measures them again" in line
        again = run_hetlaunch("up", str(cluster_yaml(tmp)), "--run-dir", str(tmp / "up-huge-2"), "--reprofile",
                              env=env, timeout=150)
        assert again.returncode == 0, again.stderr + again.stdout
    finally:
        path.write_text(json.dumps(good))


@pytest.mark.timeout(200)
def test_negative_cached_time_never_reaches_the_plan_and_the_repair_is_reused(populated):
    """The issue's `-103 tokens/s`: `up` with a negative cached time re-measures and predicts a
    positive rate; the next run uses the repaired entry without a word."""
    tmp, env, path, good = populated
    path.write_text(BAD_ENTRIES["negative_time"](good))
    result = run_hetlaunch("up", str(cluster_yaml(tmp)), "--run-dir", str(tmp / "up-negative"), env=env, timeout=150)
    assert result.returncode == 0, result.stderr + result.stdout
    said = ANSI.sub("", result.stdout + result.stderr)
    assert any(str(path) in line and "warning" in line for line in said.splitlines()), said
    summary = json.loads((tmp / "up-negative" / "summary.json").read_text())
    assert summary["plan"]["predicted_tokens_per_s"] > 0 and summary["steps"] == 3
    repaired = read_entry(path, NUM_LAYERS)
    again = run_hetlaunch("profile", str(cluster_yaml(tmp)), "-o", str(tmp / "again.json"),
                          "--run-dir", str(tmp / "run-again"), env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "warning" not in ANSI.sub("", again.stdout + again.stderr)
    assert json.loads((tmp / "again.json").read_text())["nodes"][0]["layer_seconds"] == repaired["layer_seconds"]


# --- the cache validator and writer, in process ---


def good_entry(n: int = NUM_LAYERS) -> dict:
    return {"layer_seconds": [1e-3] * n, "optimizer_seconds": [2e-4] * n,
            "codec_seconds_per_byte": {c: 1e-9 for c in CODEC_NAMES},
            "layers": [{"param_bytes": 100, "activation_bytes": 10, "output_bytes": 4096} for _ in range(n)]}


def _edited(change) -> str:
    entry = good_entry()
    change(entry)
    return json.dumps(entry)


def _set(path: tuple, value):
    def change(entry):
        target = entry
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


GOOD_TEXT = json.dumps(good_entry())
BAD_TEXTS = {
    "infinity_literal": (GOOD_TEXT.replace("0.001", "Infinity", 1), "Infinity"),
    "minus_infinity": (GOOD_TEXT.replace("0.001", "-Infinity", 1), "Infinity"),
    "overflow_in_optimizer": (GOOD_TEXT.replace("0.0002", "-1e400", 1), "optimizer_seconds.0"),
    "4000_digit_int_as_time": (GOOD_TEXT.replace("0.001", "7" * 4000, 1), "layer_seconds.0"),
    "4000_digit_int_as_bytes": (GOOD_TEXT.replace("4096", "7" * 4000, 1), "layers.0.output_bytes"),
    "bytes_over_8_pib": (_edited(_set(("layers", 1, "param_bytes"), 10 ** 20)), "layers.1.param_bytes"),
    "negative_bytes": (_edited(_set(("layers", 0, "activation_bytes"), -1)), "layers.0.activation_bytes"),
    "zero_layer_time": (_edited(_set(("layer_seconds", 3), 0)), "layer_seconds.3"),
    "absurd_layer_time": (_edited(_set(("layer_seconds", 0), 1e30)), "layer_seconds.0"),
    "negative_codec_cost": (_edited(_set(("codec_seconds_per_byte", "int8"), -1e-9)), "int8"),
    "bool_as_bytes": (_edited(_set(("layers", 0, "param_bytes"), True)), "layers.0.param_bytes"),
    "string_as_time": (_edited(_set(("layer_seconds", 0), "0.001")), "layer_seconds.0"),
    "float_as_bytes": (_edited(_set(("layers", 0, "param_bytes"), 1.5)), "layers.0.param_bytes"),
    "missing_key": (_edited(lambda e: e.pop("optimizer_seconds")), "optimizer_seconds"),
    "extra_key": (_edited(_set(("surprise",), 1)), "surprise"),
    "codec_missing": (_edited(lambda e: e["codec_seconds_per_byte"].pop("int4")), "codec_seconds_per_byte"),
    "codec_unknown": (_edited(_set(("codec_seconds_per_byte", "zip"), 1e-9)), "codec_seconds_per_byte"),
    "no_layers": (json.dumps(good_entry(0)), "layer_seconds"),
    "short_optimizer": (_edited(lambda e: e["optimizer_seconds"].pop()), "optimizer_seconds has 3 entries"),
    "short_layer_infos": (_edited(lambda e: e["layers"].pop()), "layers has 3 entries"),
    "wrong_layer_count_for_the_model": (json.dumps(good_entry(NUM_LAYERS + 1)), "for a model of 4 layers"),
    "top_level_null": ("null", "top level"),
    "top_level_number": ("3", "top level"),
    "empty_file": ("", "not valid JSON"),
    "truncated": (GOOD_TEXT[: len(GOOD_TEXT) // 2], "not valid JSON"),
    "deeply_nested": ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
    # Passed here, then failed the profile's own bound in a traceback on every later `up`.
    "cpu_per_wall_over_the_profiles_bound": (_edited(_set(("cpu_per_wall",), 1e300)), "cpu_per_wall"),
}


def parse_entry(raw: bytes, num_layers: int | None = None) -> dict:
    """read_entry of a cache file holding `raw`."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "entry.json"
        path.write_bytes(raw)
        return read_entry(path, num_layers)


@pytest.mark.parametrize("kind", sorted(BAD_TEXTS))
def test_validator_refuses_with_a_reason(kind):
    text, reason = BAD_TEXTS[kind]
    with pytest.raises(BadCacheEntry) as caught:
        parse_entry(text.encode(), NUM_LAYERS)
    message = str(caught.value)
    assert reason in message and "\n" not in message and len(message) < 400, message


def test_validator_refuses_what_json_alone_cannot_read():
    for raw, reason in [(b"\xff\xfe{}", "UTF-8"), (GOOD_TEXT.replace("4096", "9" * 5000, 1).encode(), "digits"),
                        (b" " * (MAX_ENTRY_BYTES + 1), "bytes"), (GOOD_TEXT.replace("0.001", "NaN", 1).encode(), "NaN")]:
        with pytest.raises(BadCacheEntry, match=reason):
            parse_entry(raw, NUM_LAYERS)


def test_a_cache_warning_escapes_what_the_file_holds():
    """An entry's extra key reached the terminal as it was: `\x1b]0;owned\x07` retitled the window."""
    from hetlaunch.launcher.profile_cache import _warn

    console = Recorder()
    _warn(console, "ignoring cached profile x.json (\x1b]0;owned\x07\x1b[2J: extra inputs are not permitted)")
    assert console.printed == ["warning: ignoring cached profile x.json (\\x1b]0;owned\\x07\\x1b[2J: extra inputs "
                               "are not permitted)"]


def test_validator_accepts_good_entries():
    assert parse_entry(GOOD_TEXT.encode(), NUM_LAYERS) == good_entry()
    assert parse_entry(json.dumps(good_entry(7)).encode()) == good_entry(7)  # an entrypoint: depth not known here
    check_entry(dict(good_entry(), optimizer_seconds=[0.0] * NUM_LAYERS))  # an optimizer step may round to 0


class Recorder:
    """Stands in for the rich Console: records what was printed."""

    def __init__(self):
        self.printed: list[str] = []

    def print(self, text, **_):
        self.printed.append(str(text))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETLAUNCH_CACHE_DIR", str(tmp_path / "c"))
    key = node_cache_key(device="cpu", model="m")
    return key, tmp_path / "c" / "profiles" / f"{key}.json"


def test_cached_node_reads_good_and_reports_bad_in_one_line(cache):
    key, path = cache
    console = Recorder()
    assert cached_node(key, NUM_LAYERS, console) is None and console.printed == []  # nothing cached: nothing said
    store_node(key, good_entry(), console)
    assert cached_node(key, NUM_LAYERS, console) == good_entry() and console.printed == []
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert cached_node(key, NUM_LAYERS + 2, console) is None  # another model's depth
    path.write_text(GOOD_TEXT.replace("0.001", "-5", 1))
    assert cached_node(key, NUM_LAYERS, console) is None
    assert len(console.printed) == 2 and all(str(path) in p and "\n" not in p for p in console.printed)


@pytest.mark.timeout(10)
def test_cached_node_never_blocks_on_a_fifo_nor_reads_a_directory(cache):
    key, path = cache
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    console = Recorder()
    assert cached_node(key, NUM_LAYERS, console) is None and "not a regular file" in console.printed[-1]
    path.unlink()
    path.mkdir()
    assert cached_node(key, NUM_LAYERS, console) is None and str(path) in console.printed[-1]
    store_node(key, good_entry(), console)  # cannot replace a directory: said, not raised
    assert "cannot write profile cache" in console.printed[-1]


def test_store_node_refuses_a_bad_measurement_and_survives_an_unwritable_cache(cache, tmp_path, monkeypatch):
    key, path = cache
    console = Recorder()
    store_node(key, dict(good_entry(), layer_seconds=[float("nan")] * NUM_LAYERS), console)
    assert not path.exists() and "not caching" in console.printed[-1]
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("HETLAUNCH_CACHE_DIR", str(tmp_path / "a-file"))
    store_node(key, good_entry(), console)
    assert "cannot write profile cache" in console.printed[-1] and "Not a directory" in console.printed[-1]


# --- run directories that cannot be created ---


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["under_a_file", "in_proc", "is_a_file"])
def test_unwritable_run_dir_is_one_line_naming_the_path(tmp_path, where):
    (tmp_path / "somefile").write_text("not a directory\n")
    run_dir, reason = {"under_a_file": (tmp_path / "somefile" / "run", "Not a directory"),
                       "in_proc": (Path("/proc/hetlaunch-run"), "No such file or directory"),
                       "is_a_file": (tmp_path / "somefile", "not a directory")}[where]
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
    for command in (["up", str(cluster_yaml(tmp_path))],
                    ["profile", str(cluster_yaml(tmp_path)), "-o", str(tmp_path / "p.json")]):
        result = run_hetlaunch(*command, "--run-dir", str(run_dir), env=env, timeout=60)
        assert result.returncode == 2, result.stderr + result.stdout  # the place named is at fault: exit 2, like a bad YAML
        line = the_error_line(result.stderr)
        assert f"cannot create run directory {run_dir}" in line and reason in line, line


# --- a disk that fills up ---


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault,users", [(errno.ENOSPC, False), (errno.ESTALE, False), (errno.ENOTCONN, False),
                                          (errno.EIO, False), (errno.EINVAL, True), (errno.EROFS, True)])
def test_a_run_directory_the_machine_cannot_make_is_its_fault_not_the_users(tmp_path, monkeypatch, fault, users):
    """Exit 1 (JobError) for a full disk or a dead mount, where a file in the way is the user's
    (exit 2, above) and so is a name the file system refuses (EINVAL: run:1 on vfat) or a read-only
    place; a review found a stale NFS handle taken for bad input."""
    def failing(self, *args, **kwargs):
        raise OSError(fault, os.strerror(fault), str(self))
    monkeypatch.setattr(Path, "mkdir", failing)
    with pytest.raises(JobError) as caught:
        make_run_dir(tmp_path / "run")
    assert isinstance(caught.value, BadInputError) == users and os.strerror(fault) in str(caught.value)


def test_disk_full_mid_run_is_one_line_whole_metrics_and_no_leftovers(tmp_path):
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        run_dir = disk / "run"
        env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
        # About 330 bytes a step: 400 steps are twice what this disk holds. No checkpoints: the
        # metrics file is what fills the disk here (the next test fills it with a checkpoint).
        result = run_hetlaunch("up", str(cluster_yaml(tmp_path, steps=400, checkpoint_every=0)), "--run-dir",
                               str(run_dir), env=env, timeout=150)
        assert result.returncode == 1, result.stderr + result.stdout
        line = the_error_line(result.stderr)
        assert f"cannot write {run_dir / 'metrics.jsonl'}: No space left on device" in line, line
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n") and len(text) > 10_000
        steps = [json.loads(row)["step"] for row in text.splitlines()]  # every line is whole JSON
        assert steps == list(range(len(steps))) and len(steps) < 400
        assert not (run_dir / "summary.json").exists()
    # The autouse fixture checks that no agent or CLI process is left.


@pytest.mark.timeout(180)
def test_disk_full_at_a_checkpoint_is_one_line_and_leaves_no_part_behind(tmp_path):
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        run_dir = disk / "run"
        env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
        # The model's part (parameters and AdamW state, ~200 KiB) cannot fit this disk.
        result = run_hetlaunch("up", str(cluster_yaml(tmp_path, steps=40, checkpoint_every=5)), "--run-dir",
                               str(run_dir), env=env, timeout=150)
        assert result.returncode == 1, result.stderr + result.stdout
        line = the_error_line(result.stderr)
        assert "cannot write the checkpoint of step 5 on node a" in line and "No space left on device" in line, line
        leftovers = [p for p in (run_dir / "checkpoints").rglob("*") if p.is_file() and p.name != LOCK_NAME]
        assert leftovers == [], leftovers  # no half-written part, no manifest (the directory's lock file aside)
        steps = [json.loads(row)["step"] for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(len(steps))) and 5 <= len(steps) < 40


def step(i: int, payload: int = 300) -> StepRecord:
    return StepRecord(step=i, loss=1.0, tokens_per_s=1.0, step_s=0.1, stages=[{"pad": "x" * payload}])


def test_metrics_lines_are_whole_when_the_disk_fills(tmp_path):
    with small_tmpfs(tmp_path / "disk", "32k") as disk:
        record = RunRecord(disk / "run")
        fill(disk, 4096 + 1000)  # a page and a bit: short writes happen inside a line
        with pytest.raises(JobError, match="No space left on device") as caught:
            for i in range(1000):
                record.add(step(i, payload=777))
        assert str(record.metrics_path) in str(caught.value)
        record.close()
        record.close()  # twice is fine; it never raises
        text = record.metrics_path.read_text()
        assert len(text.splitlines()) == len(record.records) >= 1
        assert [json.loads(row)["step"] for row in text.splitlines()] == list(range(len(record.records)))
        with pytest.raises(JobError, match="closed"):
            record.add(step(0))


def test_summary_is_replaced_whole_or_not_at_all(tmp_path):
    with small_tmpfs(tmp_path / "disk", "32k") as disk:
        record = RunRecord(disk / "run")
        record.add(step(0))
        record.close()
        record.write_summary({"steps": 1})
        fill(disk, 0)
        with pytest.raises(JobError) as caught:
            record.write_summary({"steps": 2, "big": "y" * 200_000})
        assert f"cannot write {disk / 'run' / 'summary.json'}: No space left on device" == str(caught.value)
        assert json.loads((disk / "run" / "summary.json").read_text()) == {"steps": 1}  # the old one, whole
        assert sorted(p.name for p in (disk / "run").iterdir()) == ["metrics.jsonl", "summary.json"]  # no temp file


def test_run_file_writers_name_the_path(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(JobError, match=r"cannot create run directory .*/f/run: Not a directory"):
        RunRecord(tmp_path / "f" / "run")
    with pytest.raises(JobError, match=r"cannot write .*/f/x.json: Not a directory"):
        write_run_file(tmp_path / "f" / "x.json", "{}")
    write_run_file(tmp_path / "token", "secret\n", mode=0o600)
    assert (tmp_path / "token").stat().st_mode & 0o777 == 0o600
