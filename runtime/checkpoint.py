"""Checkpoints as per-layer state, so that any cut of the model loads any checkpoint (reshard).

Every tensor is keyed by its GLOBAL layer index (`layers.<i>.<name>` for a layer's state_dict,
`optim.<i>.<name>.<field>` for its optimizer state: AdamW moments or SGD momentum), never by
stage: a stage of a new plan reads
exactly its layers from whichever parts hold them, whatever cut wrote them.

A checkpoint is `<root>/step-<8 digits>/`: one safetensors part per writing stage (tensors only,
no pickle: a part another host wrote cannot run code here) plus `manifest.json`. Each stage writes
its part whole (temp + fsync + rename); the coordinator writes the manifest only after every part
is reported written, and that rename is the commit. This file is the tensor half (what a stage
saves and loads); the manifest, directory names and layer keys are in runtime/checkpoint_manifest.py,
which the coordinator uses without loading torch.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from hetlaunch.runtime.checkpoint_manifest import (CHECKPOINT_FORMAT, MANIFEST_NAME, CheckpointError, Manifest,
                                                   PartInfo, layer_of, opened_part, part_path)
from hetlaunch.runtime.files import write_whole

# Optimizer state saved per parameter (max_exp_avg_sq only exists with amsgrad=True).
OPTIMIZER_FIELDS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
_ADAMW_REQUIRED = {"step", "exp_avg", "exp_avg_sq"}
_SGD_REQUIRED = {"momentum_buffer"}


def _a_count(step: Tensor) -> bool:
    """An optimizer's step as torch keeps it: one whole number, 0 or more (a float tensor)."""
    if step.numel() != 1:
        return False
    value = float(step.reshape(-1)[0])
    return math.isfinite(value) and value >= 0 and value == int(value)


def stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                layer_start: int, outer=None) -> dict[str, Tensor]:
    """This stage's parameters, buffers and optimizer state as CPU clones under global layer keys
    (with islands, `outer` (an OuterSync) adds each parameter's anchor and outer momentum as
    `outer.<i>.<name>.anchor` / `.momentum`). Cloned so that training may go on (and a writer
    thread may write) while this is kept."""
    def cpu(t: Tensor) -> Tensor:
        return t.detach().to(device="cpu", copy=True, memory_format=torch.contiguous_format)

    def global_key(local: str) -> str:
        index, _, name = local.partition(".")
        return f"{layer_start + int(index)}.{name}"

    state = {f"layers.{global_key(k)}": cpu(v) for k, v in module.state_dict().items()}
    if optimizer is not None:
        for name, param in module.named_parameters():
            saved = optimizer.state.get(param)  # absent before the first step
            for field in OPTIMIZER_FIELDS:
                if saved and isinstance(saved.get(field), Tensor):
                    state[f"optim.{global_key(name)}.{field}"] = cpu(saved[field])
    if outer is not None:
        for name, param in module.named_parameters():
            for field, tensor in outer.state_of(param).items():
                state[f"outer.{global_key(name)}.{field}"] = cpu(tensor)
    return state


def split_outer(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the layers' and optimizer's state, the islands' outer state) of a loaded checkpoint."""
    outer = {k: v for k, v in state.items() if k.startswith("outer.")}
    return {k: v for k, v in state.items() if not k.startswith("outer.")}, outer


def write_part(directory: Path, state: dict[str, Tensor], layer_start: int, layer_end: int) -> PartInfo:
    """Write one stage's state whole; the returned size and hash go into the manifest."""
    for key in state:
        layer = layer_of(key)
        if layer is None or not layer_start <= layer < layer_end:
            raise CheckpointError(f"key {key!r} does not belong to layers [{layer_start}, {layer_end})")
    name = f"layers-{layer_start}-{layer_end}.safetensors"
    data = safetensors.torch.save(state, metadata={"format": CHECKPOINT_FORMAT, "layer_start": str(layer_start),
                                                   "layer_end": str(layer_end)})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_whole(directory / name, data)
    return PartInfo(name, layer_start, layer_end, len(data), hashlib.sha256(data).hexdigest())


def load_layers(directory: Path, manifest: Manifest, layer_start: int, layer_end: int,
                verify: bool = True) -> dict[str, Tensor]:
    """Layers [layer_start, layer_end) from whichever parts hold them, reading only their tensors."""
    if not 0 <= layer_start < layer_end <= manifest.num_layers:
        raise CheckpointError(f"{directory}: layers [{layer_start}, {layer_end}) are not inside "
                              f"[0, {manifest.num_layers})")
    wanted = _holders(manifest.parts, layer_start, layer_end, directory)
    state: dict[str, Tensor] = {}
    for part, layers in wanted.items():
        path = Path(directory) / part.file
        # Read through the descriptor that was checked: a caller that verified the checkpoint
        # before (export) or a check here must not be followed by a read of a link swapped in.
        with opened_part(path, part, sha256=verify) as checked:
            _read_part(part_path(checked, path), path, part, layers, state)
    # A layer without parameters or buffers legitimately has no keys (user entrypoints may have
    # such layers); apply_state's strict check is what catches a part missing real tensors.
    return state


def _read_part(readable: str, path: Path, part: PartInfo, layers: list[tuple[int, int]],
               state: dict[str, Tensor]) -> None:
    """The tensors of `layers` from the part at `readable` (named `path` in errors) into `state`."""
    try:
        with safe_open(readable, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if (meta.get("format"), meta.get("layer_start"), meta.get("layer_end")) != (
                    CHECKPOINT_FORMAT, str(part.layer_start), str(part.layer_end)):
                raise CheckpointError(f"{path}: its metadata does not say layers "
                                      f"[{part.layer_start}, {part.layer_end}) of {CHECKPOINT_FORMAT}")
            for key in f.keys():
                layer = layer_of(key)
                if layer is not None and any(a <= layer < b for a, b in layers):
                    state[key] = f.get_tensor(key)
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None


def _holders(parts: list[PartInfo], start: int, end: int, directory: Path) -> dict[PartInfo, list[tuple[int, int]]]:
    """Each part -> the layer ranges of [start, end) it is read for: a layer from the first part
    listed that holds it (replicas overlap). By ranges, never per layer: a manifest's num_layers of
    10**12 spun export for hours (a hostile review)."""
    left = [(start, end)]  # not yet given to a part
    taken: dict[PartInfo, list[tuple[int, int]]] = {}
    for part in parts:
        rest = []
        for a, b in left:
            lo, hi = max(a, part.layer_start), min(b, part.layer_end)
            if lo >= hi:
                rest.append((a, b))
                continue
            taken.setdefault(part, []).append((lo, hi))
            rest += [r for r in ((a, lo), (hi, b)) if r[0] < r[1]]
        left = rest
    if left:
        raise CheckpointError(f"{directory / MANIFEST_NAME}: no part holds layer {min(a for a, _ in left)}")
    return taken


def resumed_step_of(train) -> int:
    """What apply_state's `resumed_step` is for a stage starting from TrainSpec `train`: its start
    step, or 0 (no optimizer state expected) under fp16, which skips the steps whose gradients
    overflowed (the first ones above all): a checkpoint of those rightly holds no optimizer state."""
    return 0 if train.precision == "fp16" else train.start_step


def _keeps_state(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether this optimizer has state after a step of a parameter with a gradient (SGD without
    momentum has none, so a checkpoint of it rightly holds none)."""
    if optimizer is None or not any(p.requires_grad for g in optimizer.param_groups for p in g["params"]):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return any(g.get("momentum", 0) for g in optimizer.param_groups)
    return True


def apply_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Tensor],
                layer_start: int, resumed_step: int = 0) -> None:
    """Load `state` (global keys) into this stage's module and optimizer, strictly; everything is
    checked before anything changes, so a refused checkpoint leaves the stage as it was.

    `resumed_step` > 0 (a resume, not a live move of untrained layers): an optimizer that keeps
    state (AdamW; SGD with momentum) must find some in the checkpoint for a stage that trains.
    A checkpoint stripped of it resumed with fresh moments, silently a different run."""
    weights: dict[str, Tensor] = {}
    moments: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state.items():
        layer = layer_of(key)
        if layer is None:
            raise CheckpointError(f"checkpoint key {key!r} names no layer")
        local = f"{layer - layer_start}.{key.split('.', 2)[2]}"  # the module's own key: "<k>.<name>"
        if key.startswith("layers."):
            weights[local] = tensor
        else:
            name, _, field = local.rpartition(".")
            moments.setdefault(name, {})[field] = tensor
    own, named = module.state_dict(), dict(module.named_parameters())
    problems = ([f"missing {k}" for k in own if k not in weights]
                + [f"unexpected {k}" for k in weights if k not in own]
                + [f"shape of {k}: {tuple(weights[k].shape)} != {tuple(own[k].shape)}"
                   for k in own if k in weights and weights[k].shape != own[k].shape]
                # load_state_dict would convert silently (bool or int64 weights resumed as if fine)
                + [f"dtype of {k}: {weights[k].dtype} != {own[k].dtype}"
                   for k in own if k in weights and weights[k].dtype != own[k].dtype])
    required = _SGD_REQUIRED if isinstance(optimizer, torch.optim.SGD) else _ADAMW_REQUIRED
    for name, fields in moments.items():
        param = named.get(name)
        if param is None or set(fields) - set(OPTIMIZER_FIELDS) or not required <= set(fields):
            problems.append(f"optimizer state {name}.{sorted(fields)} (this run's optimizer is "
                            f"{type(optimizer).__name__ if optimizer is not None else 'none'})")
        elif any(t.shape != param.shape for f, t in fields.items() if f != "step"):
            problems.append(f"shape of optimizer state of {name}")
        elif any(not t.is_floating_point() for t in fields.values()):
            problems.append(f"dtype of optimizer state of {name}: not floating point")
        elif any(t.dtype != param.dtype for f, t in fields.items() if f != "step"):  # they were cast silently
            problems.append(f"dtype of optimizer state of {name}: not {param.dtype}, the parameter's")
        elif "step" in fields and not _a_count(fields["step"]):
            # a tensor of 1,000 failed on the worker naming no file, a NaN ran the loss to nan
            problems.append(f"optimizer step of {name}: not one whole, non-negative count "
                            f"({fields['step'].numel()} value(s))")
    if resumed_step > 0 and not moments and _keeps_state(optimizer):
        problems.append(f"no optimizer state, though this run's {type(optimizer).__name__} keeps some and the "
                        f"checkpoint is of step {resumed_step}")
    if problems:
        raise CheckpointError(f"checkpoint does not fit the stage from layer {layer_start}: {problems[0]} "
                              f"(local key; {len(problems)} problem(s))")
    module.load_state_dict(weights, strict=True)
    if optimizer is None:
        return
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, fields in moments.items():
        param = named[name]
        group = groups.get(id(param))
        if group is None:
            continue  # a frozen parameter: its old state has nothing left to drive
        # AdamW keeps step as a CPU float32 scalar unless capturable or fused (then on the device).
        step_device = param.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
        optimizer.state[param] = {
            f: t.to(device=step_device, dtype=torch.float32, copy=True) if f == "step"
            else t.to(device=param.device, dtype=param.dtype, copy=True) for f, t in fields.items()}
