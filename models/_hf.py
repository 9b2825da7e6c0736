"""What the Hugging Face entrypoints share: importing transformers with a clear error, reading
only a stage's tensors from a `save_pretrained` directory, and initialising a layer from
hetlaunch's seeded RNG the way transformers would."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from hetlaunch.runtime.gpt import lm_loss
from hetlaunch.runtime.model import LayeredModel


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("Hugging Face models need transformers: pip install 'hetlaunch[hf]'") from None
    return transformers


def read_config(config_class, pretrained: str | None, sizes: dict):
    """The `save_pretrained` directory's config.json, or one made from `sizes`."""
    if not pretrained:
        return config_class(**sizes)
    path = Path(pretrained) / "config.json"
    try:
        return config_class.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise ValueError(f"pretrained: cannot read {path}: {err}") from None


def export_config(config, architecture: str) -> str:
    """config.json for `from_pretrained`: the config this run built its layers from (its sizes,
    n_positions / max_position_embeddings as trained, its tying), naming the class to load."""
    values = config.to_dict()
    values["architectures"] = [architecture]
    return json.dumps(values, indent=2, sort_keys=True) + "\n"


def layered_model(num_layers: int, config, architecture: str, make: Callable[[int], nn.Module],
                  pretrained: str | None, hf_name: Callable[[int, str], str], canonical: Callable[[str], str],
                  tied_embedding: str | None, init: Callable[[nn.Module], None]) -> LayeredModel:
    """A Hugging Face decoder as a LayeredModel: layer 0 the embeddings, the last the head (its
    `lm_head`), the rest blocks (`make(i)` builds layer i). Each built layer is loaded from
    `pretrained` (only its tensors) or initialised by `init`. `tied_embedding`: layer 0's weight
    that `lm_head.weight` is tied to, if any. `architecture`: the transformers class that
    `hetlaunch export`'s config.json names (e.g. GPT2LMHeadModel)."""
    head = num_layers - 1
    tied = (hf_name(head, "lm_head.weight"), hf_name(0, tied_embedding)) if tied_embedding else None

    def make_layer(index: int) -> nn.Module:
        layer = make(index)
        if torch.get_default_device().type == "meta":
            return layer  # only described
        if pretrained:
            names = {hf_name(index, local): local for local, _ in layer.named_parameters()}
            layer.load_state_dict(load_own(pretrained, names, canonical, tied), strict=False)
        else:
            init(layer)
        return layer

    return LayeredModel(num_layers, make_layer, lm_loss, vocab_size=config.vocab_size,
                        layer_kind=lambda i: "embeddings" if i == 0 else "head" if i == head else "block",
                        tied=((f"0.{tied_embedding}", f"{head}.lm_head.weight"),) if tied_embedding else (),
                        export_name=hf_name, export_config=export_config(config, architecture))


def load_own(pretrained: str, names: dict[str, str], canonical: Callable[[str], str],
             tied: tuple[str, str] | None = None) -> dict[str, Tensor]:
    """Only the named tensors (canonical HF name -> local name), from whichever shard holds each.
    `canonical` maps a file's key to the names used here (old files drop a prefix). `tied` =
    (head, embedding): a head the files leave out, because it is tied, is the embedding's."""
    from safetensors import safe_open

    files = sorted(Path(pretrained).glob("*.safetensors"))
    if not files:
        raise ValueError(f"pretrained: no *.safetensors files in {pretrained}")
    found: dict[str, Tensor] = {}
    embedding = None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = canonical(key)
                if name in names:
                    found[names[name]] = f.get_tensor(key)
                elif tied is not None and name == tied[1] and tied[0] in names:
                    embedding = f.get_tensor(key)
    if tied is not None and tied[0] in names and names[tied[0]] not in found and embedding is not None:
        found[names[tied[0]]] = embedding
    missing = sorted(set(names.values()) - set(found))
    if missing:
        raise ValueError(f"pretrained: {pretrained} has no tensor for {missing[0]}")
    return found


def init_layer(layer: nn.Module, std: float, residual_scale: Callable[[str], float] = lambda name: 1.0) -> None:
    """N(0, std) for matrices and embeddings (times residual_scale(module name)), zero biases,
    unit norm gains — drawn from the CPU RNG hetlaunch seeded for this layer."""
    with torch.no_grad():
        for name, module in layer.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, nn.Parameter):
                continue
            if weight.dim() == 1:  # LayerNorm, RMSNorm
                weight.fill_(1.0)
            else:
                weight.normal_(0.0, std * residual_scale(name))
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter):
                bias.zero_()


def gpt2_residual_scale(n_layer: int) -> Callable[[str], float]:
    """GPT-2's scheme: the projections into the residual stream scaled by 1/sqrt(2 n_layer)."""
    return lambda name: 1 / math.sqrt(2 * n_layer) if name.endswith("c_proj") else 1.0
