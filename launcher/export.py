"""`hetlaunch export RUN -o model.safetensors` (one file) or `-o DIR` (a directory
`from_pretrained` loads): the stages' checkpoint parts of a run, merged into one state dict of
the whole model — under the model's own names where it has them (a Hugging Face model's), else
`layers.<i>.<name>`. Into a directory go `model.safetensors` and, for a model that has one
(`LayeredModel.export_config`: the Hugging Face entrypoints), the `config.json` of the sizes and
tying the run trained, so `AutoModelForCausalLM.from_pretrained(DIR)` needs nothing else.

RUN is a run directory, a checkpoint root (its `checkpoints/` or `checkpoint.dir`) or one
committed `step-<k>` directory; the newest committed checkpoint is used. The model is named in
the checkpoint's manifest, so its entrypoint is imported here, as on an agent, and as on an
agent only where allowed: hetlaunch's own models (`hetlaunch.models.*`), or what
`--allow-entrypoint` patterns match. A checkpoint from elsewhere could name any code (a
manifest naming `os:system` ran a command). Each file is
written whole (temp, fsync, rename) or not at all; into a directory the weights go first and
config.json last, so a directory with a config.json from this export has its weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from hetlaunch.launcher.run_dir_lock import LOCK_NAME
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint_manifest import (CheckpointError, checkpoint_manifest, is_step_dir,
                                                  newest_intact_checkpoint, read_manifest)
from hetlaunch.runtime.files import new_temp_beside, write_whole
from hetlaunch.runtime.entrypoint_patterns import OWN_ENTRYPOINTS, entrypoint_allowed
from hetlaunch.runtime.wire import model_spec_from_proto


class ExportError(Exception):
    """Nothing to export, said in one line."""


@dataclass
class Exported:
    step: int
    tensors: int
    directory: Path  # the checkpoint read
    weights: Path  # the .safetensors file written
    config: Path | None = None  # the config.json written beside it, if any
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer checkpoints not intact: (step, why)


def _checkpoint(path: Path, load_layers) -> tuple[Path, object, dict, list[tuple[int, Path, str]]]:
    """(directory, manifest, its layers' tensors, the newer checkpoints skipped as not intact, with
    why): a corrupt newest manifest made export take the one before without a word (a hostile
    review). Each part is hashed as it is read, once: what is read is then what matches the
    manifest, whatever was renamed over a part (or its folder) before (export verified every part,
    then read and hashed them again: twice the reading of a large checkpoint). `load_layers` is
    runtime/checkpoint.py's, imported by export(): torch is loaded there only."""

    def loaded(step: int | None, directory: Path) -> tuple[object, dict]:
        manifest = read_manifest(directory) if step is None else checkpoint_manifest(step, directory)
        return manifest, load_layers(directory, manifest, 0, manifest.num_layers)

    if (path / "manifest.json").is_file():
        return path, *loaded(None, path), []
    for root in (path / "checkpoints", path):
        if root.is_dir():
            found, skipped = newest_intact_checkpoint(root, loaded)
            if found is not None:
                return found[0], *found[1], skipped
            if skipped:
                raise ExportError(f"{root}: no intact checkpoint; the newest, of step {skipped[0][0]}: {skipped[0][2]}")
    if (path / "events.jsonl").is_file() and not (path / "checkpoints").exists():  # a run dir, checkpoints elsewhere
        raise ExportError(f"{path}: a run directory without checkpoints/: a run whose YAML sets checkpoint.dir keeps "
                          "them there; export that directory")
    raise ExportError(f"{path}: no committed checkpoint (a run directory, a checkpoint root or a step-<k> "
                      "directory with a manifest.json)")


def _allowed(model: pb.ModelSpec, directory: Path, allow_entrypoints: tuple[str, ...]) -> None:
    if not model.HasField("entrypoint"):
        return  # the built-in GPT
    name = model.entrypoint.entrypoint
    if not entrypoint_allowed(name, (*OWN_ENTRYPOINTS, *allow_entrypoints)):
        raise ExportError(f"{directory}: the checkpoint names model entrypoint {name!r}, which export imports only "
                          f"when --allow-entrypoint matches it (a checkpoint can name any code)")


def export(path: Path, output: Path, allow_entrypoints: tuple[str, ...] = ()) -> Exported:
    # torch only here, never at the top: the rest of the launcher (the coordinator above all) runs without it.
    import torch

    from hetlaunch.runtime.checkpoint import load_layers
    from hetlaunch.runtime.model import describe_model

    try:
        directory, manifest, state, skipped = _checkpoint(path, load_layers)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    saved = manifest.extra.get("model_spec")
    if not isinstance(saved, dict):
        raise ExportError(f"{directory}: the manifest does not name its model (written before hetlaunch 0.2?)")
    try:
        proto = json_format.ParseDict(saved, pb.ModelSpec())
    except json_format.ParseError as err:
        raise ExportError(f"{directory}: the manifest's model is not readable ({str(err)[:200]})") from None
    _allowed(proto, directory, allow_entrypoints)
    spec = model_spec_from_proto(proto)
    model = describe_model(spec, seed=0)
    if model.num_layers != manifest.num_layers:
        raise ExportError(f"{directory}: {manifest.num_layers} layers, but the model {spec.describe()} has "
                          f"{model.num_layers}")
    _check_shapes(model, state, directory)
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        kind, index, local = key.split(".", 2)
        if kind != "layers":
            continue  # optimizer state stays in the checkpoint
        name = model.export_name(int(index), local) if model.export_name else key
        merged[name] = tensor.contiguous()
    weights, config = _targets(output, model.export_config is not None)
    # Nor into the checkpoint root above it, where `up` keeps a run's checkpoints (its lock file
    # says so: a step folder copied elsewhere makes no root of where it was copied to), whether
    # the path named leads there through a link or the root holds the step folder as a link.
    roots = [place.parent for place in (directory, directory.resolve())
             if is_step_dir(place.name) and (place.parent / LOCK_NAME).is_file()]
    for target in (weights, config):
        if target is not None and target.resolve().is_relative_to(directory.resolve()):
            raise ExportError(f"{target}: inside the checkpoint it exports ({directory}); write it elsewhere")
        for root in roots:
            if target is not None and target.resolve().is_relative_to(root.resolve()):
                raise ExportError(f"{target}: inside the checkpoint root of the checkpoint it exports ({root}); "
                                  "write it elsewhere")
    created = _made_by(weights.parent)
    try:
        _write(weights, config, merged, manifest.step, spec, model.export_config)
    except BaseException:
        _remove_made(created)  # a failed export into a new directory left it behind, empty
        raise
    return Exported(step=manifest.step, tensors=len(merged), directory=directory, weights=weights, config=config,
                    skipped=[(step, why) for step, _, why in skipped])


def _made_by(folder: Path) -> list[Path]:
    """Makes `folder` and the folders above it that are missing; returns those it made, outermost
    first. One that appears meanwhile (another export, or `..` in the path) is not counted as made."""
    missing = []
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except FileExistsError:
                if not folder.is_dir():
                    raise
                continue
            made.append(folder)
    except BaseException:
        _remove_made(made)
        raise
    return made


def _remove_made(made: list[Path]) -> None:
    """The folders `_made_by` made, innermost first, each only while empty."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            break


def _write(weights: Path, config: Path | None, merged: dict, step: int, spec, export_config) -> None:
    """The weights and config.json, each written whole beside its place (temp, fsync) before either
    is renamed over it: a failure while writing (a full disk) leaves what was there, never new
    weights beside an older export's config.json."""
    from safetensors.torch import save_file

    staged: list[tuple[Path, Path]] = []
    try:
        tmp = new_temp_beside(weights)
        staged.append((tmp, weights))
        mode = os.stat(tmp).st_mode & 0o777  # a plain file's (safetensors writes its own file 0600)
        save_file(merged, tmp, metadata={"format": "pt", "hetlaunch_step": str(step),
                                         "hetlaunch_model": spec.describe()})
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if config is not None:
            tmp_config = new_temp_beside(config)
            staged.append((tmp_config, config))
            write_whole(tmp_config, export_config)
        for tmp, target in staged:
            os.replace(tmp, target)
    except BaseException as err:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, Exception) and not isinstance(err, OSError):  # safetensors' own error on a full disk
            raise ExportError(f"{weights}: cannot write ({' '.join(str(err).split())[:200]})") from None
        raise


def _check_shapes(model, state: dict, directory: Path) -> None:
    """The checkpoint's weights are the model's, name for name and shape for shape. Without this a
    crafted or mismatched checkpoint exported a file that from_pretrained refused, or worse loaded
    with its sizes silently wrong. Each layer is built on the meta device: shapes, no memory."""
    import torch

    from hetlaunch.runtime.model import build_layer

    for index in range(model.num_layers):
        try:
            with torch.device("meta"):
                layer = model.make_layer(index)
        except Exception:  # model code that cannot run on meta (reads values while it builds): build it for real
            try:
                layer = build_layer(model, index, seed=0)
            except Exception as err:
                raise ExportError(f"{directory}: cannot build layer {index} of the model to check the checkpoint "
                                  f"against it ({type(err).__name__}: {' '.join(str(err).split())[:160]})") from None
        own = {f"layers.{index}.{k}": tuple(v.shape) for k, v in layer.state_dict().items()}
        saved = {k: tuple(v.shape) for k, v in state.items() if k.startswith(f"layers.{index}.")}
        problems = ([f"{k} missing" for k in own if k not in saved]
                    + [f"{k} is not the model's" for k in saved if k not in own]
                    + [f"{k} has shape {list(saved[k])}, the model's is {list(own[k])}"
                       for k in own if k in saved and saved[k] != own[k]])
        if problems:
            raise ExportError(f"{directory}: the checkpoint does not fit its model: {problems[0]}"
                              + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _targets(output: Path, has_config: bool) -> tuple[Path, Path | None]:
    """(weights file, config.json or None): a path ending in .safetensors is the one file asked
    for; anything else is a directory that takes both."""
    if output.suffix == ".safetensors":
        return output, None
    if output.exists() and not output.is_dir():
        raise ExportError(f"{output}: exists and is not a directory (name a .safetensors file, or a directory "
                          "for from_pretrained)")
    weights, config = output / "model.safetensors", (output / "config.json" if has_config else None)
    for target in (weights, config):  # the rename over a folder failed naming the temp file (a hostile review)
        if target is not None and target.is_dir():
            raise ExportError(f"{target}: a folder is in its place; move it, or export elsewhere")
    return weights, config
