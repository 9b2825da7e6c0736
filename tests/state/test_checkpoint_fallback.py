"""`up --resume` when the last checkpoint is not what was committed: it resumes from the newest
intact one, says which and why in one line, sets the bad one aside — and trains exactly as a
run that never had the bad one (the same losses step by step)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import run_hetlaunch
from small_disk import small_tmpfs
from hetlaunch.runtime.checkpoint_manifest import MANIFEST_NAME, checkpoint_dir, put_away

CLUSTER = """name: fallback
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 2}}
checkpoint: {{keep: 3}}
nodes: [{{name: a, device: cpu, threads: 1, layers: [0, 4]}}]
"""


def _up(tmp_path, run_dir, steps: int, *args: str):
    yaml = tmp_path / f"c{steps}.yaml"
    yaml.write_text(CLUSTER.format(steps=steps))
    result = run_hetlaunch("up", str(yaml), *args, str(run_dir), timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    return result


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def _part(directory):
    return directory / json.loads((directory / MANIFEST_NAME).read_text())["parts"][0]["file"]


def _truncate(directory, tmp_path):
    part = _part(directory)
    part.write_bytes(part.read_bytes()[:-100])
    return "bytes, the manifest says"


def _flip_a_byte(directory, tmp_path):
    part = _part(directory)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    return "sha256 does not match"


def _wrong_step(directory, tmp_path):
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["step"] = 2
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    return "says step 2"


def _link_elsewhere(directory, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(directory, elsewhere)
    os.symlink(elsewhere, directory)
    return "a link to"


def _no_manifest(directory, tmp_path):
    (directory / MANIFEST_NAME).unlink()
    return "no manifest"


@pytest.mark.timeout(400)
def test_a_bad_last_checkpoint_falls_back_to_the_newest_intact_one(tmp_path):
    clean = tmp_path / "clean"
    _up(tmp_path, clean, 12, "--run-dir")
    base = tmp_path / "base"
    _up(tmp_path, base, 10, "--run-dir")  # checkpoints at steps 6, 8, 10 kept
    for spoil in (_truncate, _flip_a_byte, _wrong_step, _link_elsewhere, _no_manifest):
        case = tmp_path / spoil.__name__
        shutil.copytree(base, case, symlinks=True)
        last = checkpoint_dir(case / "checkpoints", 10)
        why = spoil(last, case)
        result = _up(tmp_path, case, 12, "--resume")
        said = [line for line in result.stdout.splitlines() if "is not usable" in line]
        assert len(said) == 1 and "checkpoint of step 10" in said[0] and why in said[0], (spoil.__name__, result.stdout)
        assert "resuming from step 8" in said[0], said[0]
        if spoil is _no_manifest:  # a save that never finished, the usual trace of a crash: removed
            assert "removed (a save that never finished)" in said[0], said[0]
            assert not last.with_name(last.name + ".unusable").exists()
        else:
            assert last.with_name(last.name + ".unusable").exists()  # kept for a look
        assert not last.is_symlink() and json.loads((last / MANIFEST_NAME).read_text())["step"] == 10  # written anew
        assert _losses(case) == _losses(clean), spoil.__name__  # steps 8-11 redone exactly
        events = [json.loads(line) for line in (case / "events.jsonl").read_text().splitlines()]
        assert [e["step"] for e in events if e["event"] == "checkpoint_refused"] == [10]


def _remount(directory, read_only: bool) -> None:
    import ctypes

    flags = 32 | (1 if read_only else 0)  # MS_REMOUNT | MS_RDONLY
    if ctypes.CDLL(None, use_errno=True).mount(b"tmpfs", str(directory).encode(), b"tmpfs", flags, None) != 0:
        pytest.fail(f"remounting {directory} failed: {os.strerror(ctypes.get_errno())}")


def test_a_refused_checkpoint_is_removed_if_never_committed_set_aside_if_not_and_left_on_a_read_only_disk(tmp_path):
    """A resume from a read-only checkpoint folder ended in a traceback (the rename that sets a
    refused checkpoint aside); and every save a crash interrupted was kept as `.unusable` forever."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        committed, unfinished = checkpoint_dir(disk, 10), checkpoint_dir(disk, 12)
        for directory in (committed, unfinished):
            directory.mkdir()
            (directory / "part.safetensors").write_bytes(b"x" * 100)
        (committed / MANIFEST_NAME).write_text("{}")  # committed, then spoilt: refused for its manifest
        _remount(disk, read_only=True)
        try:
            assert put_away(committed) == ("left in place (Read-only file system)", None)
            assert put_away(unfinished) == ("left in place (Read-only file system)", None)
            assert committed.is_dir() and unfinished.is_dir()
        finally:
            _remount(disk, read_only=False)
        assert put_away(unfinished) == ("removed (a save that never finished)", None) and not unfinished.exists()
        said, aside = put_away(committed)
        assert said == f"set aside as {committed.name}.unusable" and aside == committed.with_name(said[13:])
        assert (aside / MANIFEST_NAME).exists() and not committed.exists()
    linked = checkpoint_dir(tmp_path, 14)  # its manifest a link to nowhere: not a save that never finished
    linked.mkdir()
    os.symlink(tmp_path / "nowhere.json", linked / MANIFEST_NAME)
    assert put_away(linked)[0] == f"set aside as {linked.name}.unusable"


@pytest.mark.timeout(300)
def test_a_resume_that_finds_no_checkpoint_of_a_run_that_committed_some_is_refused_not_started_over(tmp_path):
    """`up --resume` with a YAML whose checkpoint.dir is not the run's found nothing, started at step
    0 and wrote over the run's records (a hostile review). A run whose events say it committed a
    checkpoint is refused in one line naming where it was and where the resume looked."""
    run = tmp_path / "run"
    _up(tmp_path, run, 6, "--run-dir")
    recorded = (run / "metrics.jsonl").read_text()
    elsewhere = tmp_path / "c8.yaml"
    elsewhere.write_text(CLUSTER.format(steps=8).replace("checkpoint: {keep: 3}",
                                                         f"checkpoint: {{keep: 3, dir: {tmp_path / 'other'}}}"))
    result = run_hetlaunch("up", str(elsewhere), "--resume", str(run), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: cannot resume: the run committed a checkpoint of step 6 in {checkpoint_dir(run / 'checkpoints', 6)}, "
        f"but {tmp_path / 'other'} holds no intact one (is checkpoint.dir the run's?); start over with another "
        "--run-dir"], result.stderr
    assert (run / "metrics.jsonl").read_text() == recorded  # the run's records stand
    # Every checkpoint of the run spoilt: refused alike, before any of them is moved.
    for step in (2, 4, 6):
        (checkpoint_dir(run / "checkpoints", step) / MANIFEST_NAME).write_text("{}")
    result = run_hetlaunch("up", str(tmp_path / "c6.yaml"), "--resume", str(run), timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1 and "holds no intact one (3 there refused" in errors[0], \
        result.stdout + result.stderr
    assert "set aside" not in result.stdout and all(checkpoint_dir(run / "checkpoints", s).is_dir() for s in (2, 4, 6))
    assert (run / "metrics.jsonl").read_text() == recorded
