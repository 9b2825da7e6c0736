"""The coordinator's store of checkpoint parts serves only the files of a committed step's own
directory: a link planted there (to any file of the coordinator's host) or a FIFO (which held the
handler forever) is refused in one line, as is a step directory that is a link (a hostile review)."""

from __future__ import annotations

import os

import pytest

from hetlaunch.launcher.part_store import PartRefused, send
from hetlaunch.protos import control_pb2 as pb


def _served(root, checkpoint: str, file: str) -> bytes:
    return b"".join(chunk.data for chunk in send(root, pb.DownloadPartRequest(checkpoint=checkpoint, file=file)))


@pytest.fixture
def root(tmp_path):
    step = tmp_path / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "layers-0-2.safetensors").write_bytes(b"part bytes")
    (tmp_path / "secret").write_text("the coordinator's own file")
    return tmp_path / "checkpoints"


def test_a_part_of_the_step_is_served(root):
    assert _served(root, "step-00000001", "layers-0-2.safetensors") == b"part bytes"


def test_a_link_in_the_step_is_refused_not_followed(root):
    (root / "step-00000001" / "linked.safetensors").symlink_to(root.parent / "secret")
    with pytest.raises(PartRefused, match="a link, not a file of its own"):
        _served(root, "step-00000001", "linked.safetensors")


@pytest.mark.timeout(30)
def test_a_fifo_in_the_step_is_refused_at_once(root):
    os.mkfifo(root / "step-00000001" / "fifo.safetensors")
    with pytest.raises(PartRefused, match="not a regular file"):
        _served(root, "step-00000001", "fifo.safetensors")


def test_a_step_directory_that_is_a_link_is_refused(root):
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.safetensors").write_text("not of this run")
    (root / "step-00000002").symlink_to(elsewhere)
    with pytest.raises(PartRefused, match="is a link"):
        _served(root, "step-00000002", "secret.safetensors")
