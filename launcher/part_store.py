"""Checkpoint parts that cross the network: remote stages upload what they wrote, and download
the parts of the checkpoint they restore from.

Only when some agent is remote and no shared `checkpoint.dir` is set: then a part written on a
remote host would die with it, so its agent streams it here in the background (training goes
on; the part counts only once it is here). Files land only under the checkpoint root, under
names this side makes from validated pieces (a plain file name, a step, a node), and are
written whole (temporary file, fsync, rename) with their size and SHA-256 checked.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Iterable, Iterator

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint_manifest import MANIFEST_NAME, checkpoint_dir
from hetlaunch.runtime.files import UnreadableFile, open_regular_file

CHUNK_BYTES = 1 << 20
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,200}$")
_CHECKPOINT_NAME = re.compile(r"^step-\d{8,12}$")


# Held while an uploaded part lands in its step directory and while the coordinator writes a
# step's manifest (launcher/checkpoint_book.py): no part replaces one of a committed checkpoint.
COMMIT_LOCK = threading.Lock()


class PartRefused(ValueError):
    """An upload or download this side will not do; the message says why."""


def _plain(name: str, what: str) -> str:
    if not _PLAIN_NAME.match(name) or ".." in name:
        raise PartRefused(f"{what} {name[:80]!r} is not a plain file name")
    return name


def upload_target(root: Path, node: str, first: pb.PartChunk) -> Path:
    """Where an uploaded part goes: the step's directory, or the generation's snapshot directory.
    Never a manifest, and nothing into a checkpoint already committed: an agent uploaded a part
    and a manifest of its own for a step far ahead, which resume then took and pruning kept while
    it deleted the run's real checkpoints (a hostile review). The coordinator writes manifests."""
    name = _plain(first.file, "file")
    if name == MANIFEST_NAME:
        raise PartRefused(f"{name} is written by the coordinator once every part is in, never uploaded")
    if first.snapshot:
        return root / f"replica-g{first.generation}" / _plain(node, "node") / name
    directory = checkpoint_dir(root, first.step)
    if (directory / MANIFEST_NAME).exists() or directory.is_symlink():
        raise PartRefused(f"the checkpoint of step {first.step} is committed: its parts are not replaced")
    return directory / name


def receive(chunks: Iterable[pb.PartChunk], target: Path, max_bytes: int) -> pb.UploadPartResponse:
    """Write the stream's bytes to `target` whole, or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "xb") as out:
            for chunk in chunks:
                size += len(chunk.data)
                if size > max_bytes:
                    raise PartRefused(f"the upload exceeds {max_bytes:,} bytes")
                digest.update(chunk.data)
                out.write(chunk.data)
            out.flush()
            os.fsync(out.fileno())
        with COMMIT_LOCK:  # checked again as it lands: an upload begun before the commit ended after it
            if (target.parent / MANIFEST_NAME).exists():
                raise PartRefused(f"the checkpoint in {target.parent.name} was committed meanwhile: "
                                  "its parts are not replaced")
            os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return pb.UploadPartResponse(directory=str(target.parent), bytes=size, sha256=digest.hexdigest())


def send(root: Path, request: pb.DownloadPartRequest) -> Iterator[pb.PartChunk]:
    """The bytes of one file of a committed checkpoint under `root`, in chunks."""
    if not _CHECKPOINT_NAME.match(request.checkpoint):
        raise PartRefused(f"checkpoint {request.checkpoint[:80]!r} is not a step-<n> directory name")
    path = root / request.checkpoint / _plain(request.file, "file")
    if path.parent.is_symlink():
        raise PartRefused(f"checkpoint {request.checkpoint} is a link, not a directory of the run")
    try:
        # Neither a link (to any file of the coordinator's) nor a FIFO (which held the handler forever).
        f = open_regular_file(path, follow_link=False)
    except UnreadableFile as err:
        raise PartRefused(f"cannot read {request.checkpoint}/{request.file}: {err}") from None
    except OSError as err:
        raise PartRefused(f"cannot read {request.checkpoint}/{request.file}: {err.strerror or err}") from None
    with f:
        while data := f.read(CHUNK_BYTES):
            yield pb.PartChunk(data=data)
