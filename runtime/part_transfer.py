"""The agent's side of checkpoint parts that cross the network (see launcher/part_store.py).

A remote stage without a shared `checkpoint.dir` writes its parts into the agent's work
directory; the agent uploads each one to the coordinator in the background, in order, and
only then reports it (with where it now lies). Before a restore, the agent downloads the
manifest and the parts that hold its stage's layers into its work directory.
"""

from __future__ import annotations

import queue
import shutil
import sys
import threading
from pathlib import Path
from typing import Callable

import grpc

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint_manifest import MANIFEST_NAME, read_manifest
from hetlaunch.runtime.files import open_regular_file

CHUNK_BYTES = 1 << 20
TRANSFER_TIMEOUT_S = 3600.0  # a multi-GB part over a WAN link takes a while; a dead peer still ends it


def _chunks(path: Path, first: pb.PartChunk):
    with open_regular_file(path, follow_link=False) as f:  # a part this agent wrote: never a link or a FIFO
        first.data = f.read(CHUNK_BYTES)
        yield first
        while data := f.read(CHUNK_BYTES):
            yield pb.PartChunk(data=data)


class PartUploader:
    """One background thread that uploads parts in the order they were written, then reports each."""

    def __init__(self, stub, metadata, agent_id: str, report: Callable[[pb.CheckpointPart, int], None]):
        self.stub, self.metadata, self.agent_id = stub, metadata, agent_id
        self.report = report
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, part: pb.CheckpointPart, generation: int) -> None:
        self._queue.put((part, generation))

    def wait_idle(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            part, generation = self._queue.get()
            try:
                local = Path(part.directory) / part.file
                first = pb.PartChunk(agent_id=self.agent_id, generation=generation, step=part.step,
                                     snapshot=part.snapshot, file=part.file)
                reply = self.stub.UploadPart(_chunks(local, first), metadata=self.metadata, timeout=TRANSFER_TIMEOUT_S)
                if (reply.bytes, reply.sha256) != (part.bytes, part.sha256):
                    raise OSError(f"the coordinator received {reply.bytes} bytes, not {part.bytes}, or other bytes")
                local.unlink(missing_ok=True)  # it lives on the coordinator now; keep this disk bounded
                uploaded = pb.CheckpointPart()
                uploaded.CopyFrom(part)
                uploaded.directory = reply.directory
                self.report(uploaded, generation)
            except (grpc.RpcError, OSError) as err:  # unreported: the checkpoint is not committed
                detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
                print(f"uploading checkpoint part {part.file} of step {part.step} failed: {detail}",
                      file=sys.stderr, flush=True)
            finally:
                self._queue.task_done()


def _download(stub, metadata, agent_id: str, checkpoint: str, file: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    with open(tmp, "wb") as out:
        for chunk in stub.DownloadPart(pb.DownloadPartRequest(agent_id=agent_id, checkpoint=checkpoint, file=file),
                                       metadata=metadata, timeout=TRANSFER_TIMEOUT_S):
            out.write(chunk.data)
    tmp.replace(target)


def download_checkpoint(stub, metadata, agent_id: str, checkpoint: str, layer_start: int, layer_end: int,
                        work_dir: Path) -> Path:
    """Fetch the manifest of `checkpoint` (a step-<n> name) and the parts holding layers
    [layer_start, layer_end) into work_dir; return the local checkpoint directory. The worker
    checks every part's size and SHA-256 against the manifest before it loads anything."""
    local = work_dir / "restore" / checkpoint
    shutil.rmtree(local, ignore_errors=True)
    _download(stub, metadata, agent_id, checkpoint, MANIFEST_NAME, local / MANIFEST_NAME)
    manifest = read_manifest(local)
    for part in manifest.parts:
        if part.layer_start < layer_end and layer_start < part.layer_end:
            _download(stub, metadata, agent_id, checkpoint, part.file, local / part.file)
    return local
