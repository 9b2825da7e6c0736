"""The coordinator's side of checkpoints: which parts a step needs, committing it, and what to restore.

A checkpoint at step k is committed when the designated writer of every layer (the stages of
the plan's first pipeline) has reported its part of step k written: then, and only then, the
manifest is written (temp, fsync, rename), so a crash mid-save leaves the previous checkpoint
the latest one. After a lost node, surviving stages of a several-pipeline plan snapshot their
layers; where those cover the whole model at a newer step than the last checkpoint, the
snapshots are committed as a checkpoint of their own (source "replica") and no step is lost.

Writers are keyed as Topology.checkpoint_writers keys them, (node, stage index), but a part on the
wire names only its node and its layers. A node with one stage is its writer whatever layers its
part names (a live move changes them within a generation). A node with several stages (interleaved
1F1B, ZB-V, where live moves are refused) writes one part per stage, and the layer a part starts
at tells which of its stages wrote it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.part_store import COMMIT_LOCK
from hetlaunch.launcher.planning.topology import Placement
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint_manifest import (CheckpointError, PartInfo, checkpoint_dir, latest_checkpoint,
                                                   prune_checkpoints, write_manifest)


@dataclass(frozen=True)
class Restore:
    step: int             # the next step to run
    directory: Path | None  # the committed checkpoint to load; None: the seeded init
    source: str           # "file", "replica" or "init"


class CheckpointBook:
    def __init__(self, root: Path, keep: int, num_layers: int, extra: dict):
        self.root = root
        self.keep = keep
        self.num_layers = num_layers
        self.extra = extra
        self._writers: dict[tuple[str, int], Placement] = {}  # (node, stage index) -> the stage
        # node -> its writer's key; with several stages, first layer -> the key of the stage starting there
        self._writer_of: dict[str, tuple[str, int] | dict[int, tuple[str, int]]] = {}
        self._parts: dict[int, dict[tuple[str, int], pb.CheckpointPart]] = {}  # step -> writer -> its part
        self._committed_through = -1  # the newest step this generation committed from its parts
        self.snapshots: dict[str, pb.CheckpointPart] = {}  # node -> the snapshot it wrote this generation
        self.committed = 0
        self.write_s: list[float] = []
        self.stall_s: list[float] = []
        found = latest_checkpoint(root) if root.exists() else None
        self.latest: tuple[int, Path] | None = (found[1].step, found[0]) if found else None

    def expect(self, writers: dict[tuple[str, int], Placement]) -> None:
        """A new generation: these stages (Topology.checkpoint_writers) write its checkpoints;
        parts of earlier ones are dropped."""
        by_node: dict[str, list[tuple[tuple[str, int], Placement]]] = {}
        for key, q in writers.items():
            by_node.setdefault(q.node, []).append((key, q))
        self._writers = dict(writers)
        self._writer_of = {node: mine[0][0] if len(mine) == 1 else {q.layer_start: key for key, q in mine}
                           for node, mine in by_node.items()}
        self._parts.clear()
        self._committed_through = -1
        self.snapshots.clear()

    def add(self, node: str, part: pb.CheckpointPart, source: str = "file") -> int | None:
        """A part was written; returns the step if that completed (and committed) a checkpoint.
        Snapshots (written by failing or aborted stages) are kept for commit_snapshots."""
        if part.error:  # e.g. a full disk: the run cannot keep its promise to be resumable
            raise JobError(f"cannot write the checkpoint of step {part.step} on node {node}: {part.error}")
        if part.snapshot:
            self.snapshots[node] = part
            return None
        writer = self._writer_of.get(node)
        if isinstance(writer, dict):  # one of the node's several stages: the one whose layers start there
            writer = writer.get(part.layer_start)
        if writer is None:
            return None
        if part.step <= self._committed_through or writer in self._parts.get(part.step, {}):
            # A report sent again (runtime/agent_job.py, while `up` was stopped) whose first copy did
            # arrive: committed twice, it counted two checkpoints and their write times twice.
            return None
        self.write_s.append(part.write_s)
        self.stall_s.append(part.stall_s)
        parts = self._parts.setdefault(part.step, {})
        parts[writer] = part
        if set(parts) != set(self._writers):
            return None
        del self._parts[part.step]
        self._commit(part.step, list(parts.values()), source)
        self._committed_through = part.step
        return part.step

    def _commit(self, step: int, parts: list[pb.CheckpointPart], source: str) -> None:
        directory = checkpoint_dir(self.root, step)
        infos = [PartInfo(file=p.file, layer_start=p.layer_start, layer_end=p.layer_end, bytes=p.bytes,
                          sha256=p.sha256) for p in parts]
        try:
            with COMMIT_LOCK:  # no uploaded part lands in the directory while it is committed
                write_manifest(directory, step, self.num_layers, infos, {**self.extra, "source": source})
            prune_checkpoints(self.root, self.keep)
        except (CheckpointError, OSError) as err:
            raise JobError(f"cannot commit the checkpoint of step {step} in {directory}: {err}") from None
        self.committed += 1
        self.latest = (step, directory)

    def commit_snapshots(self, islands: list[set[str]] | None = None) -> int | None:
        """Commit the newest step at which the survivors' snapshots hold every layer, if it is newer
        than the latest checkpoint; returns that step. The chosen files move into the step's
        directory (one rename each, same file system) before the manifest is written. With
        `islands` (node sets), the parts come from one island: replicas agree only inside one."""
        by_step: dict[int, list[tuple[str, pb.CheckpointPart]]] = {}
        for node, part in self.snapshots.items():
            by_step.setdefault(part.step, []).append((node, part))
        latest_step = self.latest[0] if self.latest else 0
        for step in sorted(by_step, reverse=True):
            if step <= latest_step:
                break
            chosen = None
            for members in islands or [None]:
                chosen = _cover([p for n, p in by_step[step] if members is None or n in members], self.num_layers)
                if chosen is not None:
                    break
            if chosen is None:
                continue
            directory = checkpoint_dir(self.root, step)
            if directory.exists():  # parts of an interrupted save of this step: not committed, not ours now
                shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            moved = []
            for i, part in enumerate(chosen):
                name = f"replica{i}-{part.file}"
                os.replace(Path(part.directory) / part.file, directory / name)
                moved.append(pb.CheckpointPart(file=name, layer_start=part.layer_start, layer_end=part.layer_end,
                                               bytes=part.bytes, sha256=part.sha256, step=step))
            self._commit(step, moved, "replica")
            return step
        return None

    def restore_point(self, source: str) -> Restore:
        if self.latest is None:
            return Restore(0, None, "init")
        return Restore(self.latest[0], self.latest[1], source)


def _cover(parts: list[pb.CheckpointPart], num_layers: int) -> list[pb.CheckpointPart] | None:
    """Parts that together hold layers [0, num_layers): greedily the one reaching furthest."""
    chosen, reached = [], 0
    while reached < num_layers:
        best = max((p for p in parts if p.layer_start <= reached < p.layer_end), key=lambda p: p.layer_end,
                   default=None)
        if best is None:
            return None
        chosen.append(best)
        reached = best.layer_end
    return chosen
