"""How `hetlaunch export` writes (launcher/export.py `_write`, `_made_by`): the weights and config.json
both or neither, the folders it made and only those removed on failure, files as plain files are."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from hetlaunch.launcher import export

pytestmark = pytest.mark.quick


class _Spec:
    def describe(self) -> str:
        return "a test model"


def test_a_config_that_cannot_be_written_leaves_the_earlier_export_whole(tmp_path, monkeypatch):
    """A review: new weights were renamed over an earlier export's before its config.json failed,
    which stayed: the pair no longer matched."""
    (tmp_path / "model.safetensors").write_bytes(b"OLD")
    (tmp_path / "config.json").write_text('{"old": true}')

    def full_disk(path, text, mode=0o666):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(export, "write_whole", full_disk)
    with pytest.raises(OSError):
        export._write(tmp_path / "model.safetensors", tmp_path / "config.json", {"w": torch.zeros(2)}, 3, _Spec(),
                      {"new": True})
    assert (tmp_path / "model.safetensors").read_bytes() == b"OLD"
    assert (tmp_path / "config.json").read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temp left


def test_weights_are_written_as_plain_files_are(tmp_path):
    """safetensors writes its file 0600: an export was unreadable to the user's group."""
    umask = os.umask(0o022)
    try:
        export._write(tmp_path / "model.safetensors", None, {"w": torch.zeros(2)}, 3, _Spec(), None)
    finally:
        os.umask(umask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_folders_are_made_through_dot_dot_and_beside_a_racing_export(tmp_path):
    """A review: `-o nd/../out` failed with File exists, and two exports making the same new parent
    failed one in sixteen."""
    made = export._made_by(tmp_path / "nd" / ".." / "out")
    assert (tmp_path / "out").is_dir() and (tmp_path / "nd").is_dir()
    assert tmp_path / "nd" / ".." not in made
    export._remove_made(made)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    errors = []

    def make(round_: int, i: int) -> None:
        try:  # pairs of exports into new folders under the same new parent
            export._made_by(tmp_path / f"race{round_}" / str(i % 3) / f"out{i}")
        except OSError as err:
            errors.append(err)
    for round_ in range(30):
        threads = [threading.Thread(target=make, args=(round_, i)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert errors == []


def test_a_run_whose_checkpoints_went_elsewhere_is_told_where_to_look(tmp_path):
    """A review: `export RUN` of a run with checkpoint.dir said only "no committed checkpoint"."""
    (tmp_path / "events.jsonl").write_text("")
    with pytest.raises(export.ExportError, match="checkpoint.dir keeps them there; export that directory"):
        export._checkpoint(tmp_path, lambda *args: pytest.fail("no checkpoint to load here"))

