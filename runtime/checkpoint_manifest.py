"""The torch-free half of a checkpoint: its directory names, its manifest, its layer keys.

A checkpoint is `<root>/step-<8 digits>/`: one safetensors part per writing stage plus
`manifest.json`, which the coordinator writes only after every part is reported written; that
rename is the commit. A directory without a manifest is an interrupted save: never loaded,
pruned once a newer checkpoint is committed. Tensors are keyed by GLOBAL layer index
(`layers.<i>.<name>`, `optim.<i>.<name>.<field>`), never by stage.

Kept apart from runtime/checkpoint.py (the tensors a stage saves and loads) so that the
coordinator, which commits, finds, prunes and resumes checkpoints, never loads torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from hetlaunch.runtime.files import UnreadableFile, open_regular_file, read_json, write_whole

T = TypeVar("T")

CHECKPOINT_FORMAT = "hetlaunch-checkpoint/1"
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
_STEP_DIR = re.compile(r"step-(\d{8,})")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_step_dir(name: str) -> bool:
    """Whether a folder name is a checkpoint's (step-00000004) under a checkpoint root."""
    return _STEP_DIR.fullmatch(name) is not None


class CheckpointError(ValueError):
    """One-line reason a checkpoint cannot be written or used, naming the file."""


def _int(d: dict, key: str, minimum: int, where: str) -> int:
    value = d.get(key)
    if type(value) is not int or value < minimum:  # bool is an int subclass: excluded on purpose
        raise CheckpointError(f"{where}: {key} must be an integer >= {minimum}, got {value!r:.80}")
    return value


def _exact_keys(d: object, keys: set[str], where: str) -> dict:
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise CheckpointError(f"{where}: expected an object with keys {sorted(keys)}, got {str(got):.200}")
    return d


@dataclass(frozen=True)
class PartInfo:
    file: str  # a plain name inside the checkpoint directory
    layer_start: int
    layer_end: int
    bytes: int
    sha256: str

    def to_dict(self) -> dict:
        return {"file": self.file, "layer_start": self.layer_start, "layer_end": self.layer_end,
                "bytes": self.bytes, "sha256": self.sha256}

    @staticmethod
    def from_dict(d: object, where: str = "part") -> PartInfo:
        d = _exact_keys(d, {"file", "layer_start", "layer_end", "bytes", "sha256"}, where)
        name = d["file"]
        # A manifest names files only inside its own directory: no path, no hidden/temp files.
        if (not isinstance(name, str) or not name or len(name) > 255 or name.startswith(".")
                or any(c in name for c in "/\\\0") or name == MANIFEST_NAME):
            raise CheckpointError(f"{where}: file must be a plain file name, got {name!r:.80}")
        start, end = _int(d, "layer_start", 0, where), _int(d, "layer_end", 1, where)
        if start >= end:
            raise CheckpointError(f"{where}: empty layer range [{start}, {end})")
        if not isinstance(d["sha256"], str) or not _SHA256.fullmatch(d["sha256"]):
            raise CheckpointError(f"{where}: sha256 must be 64 lowercase hex digits")
        return PartInfo(name, start, end, _int(d, "bytes", 0, where), d["sha256"])


@dataclass(frozen=True)
class Manifest:
    step: int  # optimizer steps completed = the next step to run
    num_layers: int
    parts: list[PartInfo]
    extra: dict  # free JSON: model description, data seed, plan, source...

    def to_dict(self) -> dict:
        return {"format": CHECKPOINT_FORMAT, "step": self.step, "num_layers": self.num_layers,
                "parts": [p.to_dict() for p in self.parts], "extra": self.extra}

    @staticmethod
    def from_dict(d: object, where: str = "manifest") -> Manifest:
        d = _exact_keys(d, {"format", "step", "num_layers", "parts", "extra"}, where)
        if d["format"] != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{where}: format is {d['format']!r:.80}, expected {CHECKPOINT_FORMAT!r}")
        if not isinstance(d["parts"], list) or not isinstance(d["extra"], dict):
            raise CheckpointError(f"{where}: parts must be a list and extra an object")
        parts = [PartInfo.from_dict(p, f"{where}: parts[{i}]") for i, p in enumerate(d["parts"])]
        manifest = Manifest(_int(d, "step", 0, where), _int(d, "num_layers", 1, where), parts, d["extra"])
        _check_parts(manifest.parts, manifest.num_layers, where)
        return manifest


def _check_parts(parts: list[PartInfo], num_layers: int, where: str) -> None:
    """Parts must name distinct files and together cover [0, num_layers); overlap is fine (replicas).
    Works on the ranges, never per layer: a hostile num_layers of 10**100 costs nothing."""
    if len({p.file for p in parts}) != len(parts):
        raise CheckpointError(f"{where}: a part file is listed twice")
    reached = 0
    for part in sorted(parts, key=lambda p: p.layer_start):
        if part.layer_end > num_layers:
            raise CheckpointError(f"{where}: {part.file} ends at layer {part.layer_end} > num_layers {num_layers}")
        if part.layer_start > reached:
            break
        reached = max(reached, part.layer_end)
    if reached < num_layers:
        raise CheckpointError(f"{where}: no part holds layer {reached} (the model has {num_layers} layers)")


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def layer_of(key: str) -> int | None:
    """The global layer index of a `layers.<i>.`, `optim.<i>.` or `outer.<i>.` key (the last: islands'
    anchor and outer momentum, runtime/outer_sync.py); None for anything else."""
    kind, _, rest = key.partition(".")
    index, dot, _ = rest.partition(".")
    ok = kind in ("layers", "optim", "outer") and dot and index.isascii() and index.isdigit()
    return int(index) if ok else None


def write_manifest(directory: Path, step: int, num_layers: int, parts: list[PartInfo], extra: dict) -> Path:
    """Commit the checkpoint: after this rename it exists; before it, it does not."""
    directory = Path(directory)
    manifest = Manifest(step, num_layers, list(parts), extra)
    try:  # the same checks a reader makes, so we never commit what read_manifest would refuse
        text = json.dumps(manifest.to_dict(), indent=1, allow_nan=False)
        Manifest.from_dict(manifest.to_dict(), str(directory / MANIFEST_NAME))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{directory / MANIFEST_NAME}: {err}") from None
    for part in parts:
        check_part_file(directory / part.file, part, sha256=False)
    path = directory / MANIFEST_NAME
    write_whole(path, text)
    return path


def check_part_file(path: Path, part: PartInfo, sha256: bool) -> None:
    """Is this the file the manifest names: its size, and with `sha256` its content."""
    with opened_part(path, part, sha256):
        pass


@contextlib.contextmanager
def opened_part(path: Path, part: PartInfo, sha256: bool):
    """The part open for binary reading once check_part_file's checks pass on what was opened:
    the caller reads the file that was checked (part_path gives a path to it), not whatever the
    name points at by the time it reads (a link or another file renamed over it after the check).
    Not covered: the same file rewritten in place after its hash, by someone who may write it."""
    digest = hashlib.sha256()
    try:
        # Not blocking: a FIFO or /dev/zero in a part's place (with a manifest saying 0 bytes) held
        # export and resume forever. Not a link either: the run writes its parts as files, and a
        # checkpoint handed over could link one to any file of the reader's.
        f = open_regular_file(path, follow_link=False)
    except UnreadableFile as err:
        raise CheckpointError(f"{path}: {err}") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if sha256 and size == part.bytes:
                while chunk := f.read(1 << 22):
                    digest.update(chunk)
                f.seek(0)
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
        if size != part.bytes:
            raise CheckpointError(f"{path}: {size} bytes, the manifest says {part.bytes}")
        if sha256 and digest.hexdigest() != part.sha256:
            raise CheckpointError(f"{path}: sha256 does not match the manifest (changed after it was written)")
        yield f


def part_path(opened, path: Path) -> str:
    """A path that opens the file `opened` (opened_part's) itself, for a reader that takes a path
    (safetensors' safe_open): /proc/self/fd/N on Linux, /dev/fd/N elsewhere, each of which reaches
    that file even after its name was pointed elsewhere. CheckpointError where neither exists: the
    name itself could be another file by now."""
    for by_descriptor in (f"/proc/self/fd/{opened.fileno()}", f"/dev/fd/{opened.fileno()}"):
        if os.path.exists(by_descriptor):
            return by_descriptor
    raise CheckpointError(f"{path}: cannot read it through the descriptor that was checked "
                          "(neither /proc/self/fd nor /dev/fd is there)")


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = read_json(path, MAX_MANIFEST_BYTES, follow_link=False)  # written by the run, never a link
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no manifest (the checkpoint was never committed)") from None
    except UnreadableFile as err:
        raise CheckpointError(f"{path}: {err}") from None
    return Manifest.from_dict(raw, str(path))


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every step directory under root as (step, path), newest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), Path(root) / n) for n in names if (m := _STEP_DIR.fullmatch(n))]
    # Only the canonical spelling: "step-000000002" must not shadow (or be pruned as) step 2.
    return sorted(((s, d) for s, d in found if d == checkpoint_dir(root, s) and d.is_dir()), reverse=True)


def _manifest_of(step: int, directory: Path) -> Manifest | None:
    try:
        manifest = read_manifest(directory)
    except CheckpointError:
        return None  # uncommitted, or broken by someone else: never worth crashing a job over
    # A manifest copied under another step's name would resume at the wrong step.
    return manifest if manifest.step == step else None


def latest_checkpoint(root: Path) -> tuple[Path, Manifest] | None:
    return next(((d, m) for s, d in _step_dirs(root) if (m := _manifest_of(s, d)) is not None), None)


def verify_checkpoint(step: int, directory: Path) -> Manifest:
    """The manifest of the checkpoint of `step` in `directory`, once everything it names is as
    written: a directory of its own (not a link to elsewhere), the manifest of that step, every
    part's size and sha256. CheckpointError (one line) naming what is not."""
    manifest = checkpoint_manifest(step, directory)
    for part in manifest.parts:
        check_part_file(directory / part.file, part, sha256=True)
    return manifest


def checkpoint_manifest(step: int, directory: Path) -> Manifest:
    """verify_checkpoint without the parts: for a reader that hashes them as it reads them."""
    if directory.is_symlink():
        raise CheckpointError(f"{directory}: a link to {os.readlink(directory)!r:.120}, not a directory of the run")
    manifest = read_manifest(directory)
    if manifest.step != step:
        raise CheckpointError(f"{directory / MANIFEST_NAME}: says step {manifest.step}, in the directory of step {step}")
    return manifest


def newest_intact_checkpoint(root: Path, accept: Callable[[int, Path], T] = verify_checkpoint,
                             ) -> tuple[tuple[Path, T] | None, list[tuple[int, Path, str]]]:
    """The newest checkpoint that `accept` takes (verify_checkpoint: its manifest, everything
    checked), with what `accept` returned, and the newer ones it refused (step, directory, why),
    newest first."""
    refused = []
    for step, directory in _step_dirs(root):
        try:
            return (directory, accept(step, directory)), refused
        except CheckpointError as err:
            refused.append((step, directory, str(err)))
    return None, refused


def put_away(directory: Path) -> tuple[str, Path | None]:
    """What becomes of a checkpoint a resume refused, said as the resume says it, and where it went:
    a save the run stopped in (no manifest: nothing of it was ever committed, the usual trace of a
    crash) is removed; any other is set aside for a look. Where the file system refuses (read only),
    it is left in place: never loaded either way, it must not stop the resume."""
    try:
        if not directory.is_symlink() and not os.path.lexists(directory / MANIFEST_NAME):  # a link counts as one
            shutil.rmtree(directory)
            return "removed (a save that never finished)", None
        aside = set_aside(directory)
        return f"set aside as {aside.name}", aside
    except OSError as err:
        return f"left in place ({err.strerror or err})", None


def set_aside(directory: Path) -> Path:
    """Rename a refused checkpoint out of the run's step directories (kept for a look, never
    loaded or counted again: a broken newer one must not make pruning delete the good ones)."""
    for n in range(100):
        target = directory.with_name(f"{directory.name}.unusable" + (f".{n}" if n else ""))
        if not target.exists() and not target.is_symlink():
            directory.rename(target)
            return target
    raise CheckpointError(f"{directory}: cannot set it aside (100 earlier copies set aside)")


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints; remove older ones and the leftovers of
    interrupted saves older than the newest commit. Directories newer than that may be a save
    in progress and are never touched."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is never removed), got {keep}")
    kept = 0
    for step, directory in _step_dirs(root):
        if kept < keep and _manifest_of(step, directory) is not None:
            kept += 1
            continue
        if kept == 0:
            continue  # newer than every committed checkpoint: possibly being written right now
        if directory.is_symlink():
            directory.unlink()
            continue
        # Un-commit first, so a crash halfway through the removal never leaves a manifest
        # that names parts already deleted.
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
