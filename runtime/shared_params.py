"""Parameters that the `(layers, loss_fn)` entrypoint form shares between layers — one Parameter
object in two layers, as Hugging Face ties GPT-2's `lm_head.weight` to `wte.weight` — made
into `LayeredModel.tied` groups.

Why: a stage keeps only its slice of the layers, so a Parameter shared across a cut would
become two copies in two processes, each trained on half the gradient, silently. Instead the
sharing is found when the model is described (so when layers are counted, on the meta device
too: object identity survives there), each shared Parameter becomes one tied group named
"<layer>.<name>", and every layer after the first holder gets its own copy of it. From then on
runtime/tied.py treats it exactly as `LayeredModel(tied=...)`: the holders start from one value
and sum their gradients every step, also when one stage holds every copy, so every cut does the
same arithmetic. Sharing inside one layer stays as it is (a stage always holds the whole layer).
"""

from __future__ import annotations

import copy

from torch import nn


def shared_groups(layers: list[nn.Module]) -> tuple[tuple[str, ...], ...]:
    """Each trainable Parameter held by more than one layer, as its names "<layer>.<name>", one
    per holding layer, in order of first appearance (every rank builds its tie groups in this
    order, which c10d requires to be the same everywhere)."""
    names: dict[int, list[str]] = {}
    for index, layer in enumerate(layers):
        # named_parameters names a Parameter once per layer, which is what a stage can look up.
        for name, param in layer.named_parameters():
            if param.requires_grad:  # a frozen one stays equal in every copy without help
                names.setdefault(id(param), []).append(f"{index}.{name}")
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def untie(layers: list[nn.Module], groups: tuple[tuple[str, ...], ...]) -> list[nn.Module]:
    """`layers` with every layer that shares a tensor with an earlier one replaced by a deep copy
    of itself: its own Parameters (and submodules), equal in value, sharing within it kept."""
    if not groups:
        return layers
    out: list[nn.Module] = []
    earlier: set[int] = set()
    for index, layer in enumerate(layers):
        tensors = {id(t) for t in layer.parameters()} | {id(t) for t in layer.buffers()}
        if tensors & earlier:
            try:
                layer = copy.deepcopy(layer)
            except Exception as err:  # a module holding something that cannot be copied
                shared = ", ".join(name for group in groups for name in group)
                raise ValueError(f"layers share parameters ({shared}) and layer {index} cannot be copied to tie them "
                                 f"across stages ({type(err).__name__}: {err}); build the layers without sharing "
                                 f"and declare LayeredModel(tied=...) instead") from None
        earlier |= tensors
        out.append(layer)
    return out
