"""Models as an ordered list of layers, so any contiguous range can be a pipeline stage, and a
stage allocates only its own layers.

Two sources of models: the built-in GPT (runtime/gpt.py) and a user entrypoint
``"package.module:function"``. ``function(**kwargs)`` returns one of:

* a ``LayeredModel(num_layers, make_layer, loss_fn)`` (the form for models of any size):
  ``make_layer(i)`` builds layer ``i`` alone. hetlaunch calls it only for the layers a stage
  holds, each under the CPU RNG seeded from ``(seed, i)``, so any cut gives the same weights and
  no process ever holds the whole model. It is also called under ``torch.device("meta")`` to
  learn a layer's structure without allocating it (layers of one structure are profiled once),
  so it must not read tensor values while building;
* ``(layers, loss_fn)``, an ordered list/tuple/``nn.ModuleList``/``nn.Sequential`` of
  ``nn.Module`` (the old form, fine for small models): the whole model is built under one fixed
  seed and a stage keeps its slice. A Parameter shared by several layers (Hugging Face's tied
  ``lm_head.weight``) is tied across stages as ``LayeredModel.tied`` declares it.

Either way: layer 0 receives the input batch, a LongTensor ``[B, T]`` of token ids; every layer
returns exactly one tensor, the only input of the next layer (what crosses a stage link);
``loss_fn(last_output, targets)`` returns a scalar; parameters are created on CPU (the executor
moves them); ``kwargs["seq_len"]`` is the sequence length the data pipeline uses. Building never
touches the caller's RNG state.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Hashable

import torch
from torch import Tensor, nn

from hetlaunch.runtime.gpt import gpt_layer_kind, lm_loss, make_gpt_layer
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.shared_params import shared_groups, untie

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LayeredModel:
    """A model described without allocating it: its depth, how to build one layer, its loss."""

    num_layers: int
    make_layer: Callable[[int], nn.Module]
    loss_fn: LossFn
    # Token ids the first layer accepts; profiling draws inputs below it (None: 256, bytes).
    vocab_size: int | None = None
    # Layers with equal kinds cost the same (profiled once); None: judged from their structure.
    layer_kind: Callable[[int], Hashable] | None = None
    # Parameters that are one parameter, by global name "<layer>.<name>" (GPT-2's embedding and
    # output projection): their holders sum gradients every step (runtime/tied.py).
    tied: tuple[tuple[str, ...], ...] = ()
    # `hetlaunch export`'s name for a layer's parameter (e.g. Hugging Face's); None: "layers.<i>.<name>".
    export_name: Callable[[int, str], str] | None = None
    # The config.json text `hetlaunch export -o DIR` writes beside the weights, so that
    # `from_pretrained(DIR)` builds the model the run trained (its real sizes and tying); None: none.
    export_config: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise TypeError(f"LayeredModel.num_layers must be a positive int, got {self.num_layers!r}")
        if not callable(self.make_layer) or not callable(self.loss_fn):
            raise TypeError("LayeredModel.make_layer and LayeredModel.loss_fn must be callable")


def layer_seed(seed: int, index: int) -> int:
    # A hash rather than arithmetic so distinct (seed, index) pairs never collide and negative
    # seeds are fine; 63 bits fits every generator.
    digest = hashlib.blake2b(f"hetlaunch-layer:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _check_range(start: int, end: int, num_layers: int) -> None:
    if not (0 <= start < end <= num_layers):
        raise ValueError(
            f"layer range [{start}, {end}) is not a non-empty range inside [0, {num_layers})"
        )


def _resolve_entrypoint(entrypoint: str) -> Callable:
    module_name, sep, func_name = entrypoint.partition(":")
    if (
        not sep
        or not func_name.isidentifier()
        or not all(part.isidentifier() for part in module_name.split("."))
    ):
        raise ValueError(f"model.entrypoint must look like 'package.module:function', got {entrypoint!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"model.entrypoint {entrypoint!r}: cannot import module {module_name!r} ({e})"
        ) from e
    func = getattr(module, func_name, None)
    if func is None:
        raise ValueError(f"model.entrypoint {entrypoint!r}: module {module_name!r} has no attribute {func_name!r}")
    if not callable(func):
        raise ValueError(f"model.entrypoint {entrypoint!r}: {func_name!r} is not callable")
    return func


_CONTRACT = (
    "it must return a hetlaunch.runtime.model.LayeredModel or (layers, loss_fn): layers a non-empty "
    "list/tuple/nn.ModuleList/nn.Sequential of nn.Module, loss_fn a callable (last_output, targets) -> scalar"
)


def _call_entrypoint(entrypoint: str, kwargs: dict, seed: int):
    func = _resolve_entrypoint(entrypoint)
    # Seed only the CPU generator, inside a fork, so every process gets the same weights and the
    # caller's RNG streams (CPU and CUDA) are left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return func(**kwargs)


def _checked_pair(entrypoint: str, result) -> tuple[list[nn.Module], LossFn]:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"model.entrypoint {entrypoint!r} returned {type(result).__name__}; {_CONTRACT}")
    layers, loss_fn = result
    if not isinstance(layers, (list, tuple, nn.ModuleList, nn.Sequential)):
        raise TypeError(f"model.entrypoint {entrypoint!r} returned layers of type {type(layers).__name__}; {_CONTRACT}")
    layers = list(layers)
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise TypeError(f"model.entrypoint {entrypoint!r} returned empty layers or a non-nn.Module layer; {_CONTRACT}")
    if not callable(loss_fn):
        raise TypeError(f"model.entrypoint {entrypoint!r} returned a non-callable loss_fn; {_CONTRACT}")
    return layers, loss_fn


def load_entrypoint_layers(entrypoint: str, kwargs: dict, seed: int) -> tuple[list[nn.Module], LossFn]:
    """The old form, whole: import ``package.module:function`` and build every layer."""
    return _checked_pair(entrypoint, _call_entrypoint(entrypoint, kwargs, seed))


def _structure(layer: nn.Module) -> Hashable:
    """What a layer's cost depends on, read without running it: its class, its printed structure
    (sizes of its submodules) and its tensors' names, shapes and dtypes."""
    tensors = [(name, tuple(t.shape), str(t.dtype)) for name, t in layer.named_parameters()]
    tensors += [(name, tuple(t.shape), str(t.dtype)) for name, t in layer.named_buffers()]
    return (type(layer).__qualname__, repr(layer), tuple(tensors))


def _is_meta(layers: list[nn.Module]) -> bool:
    return any(t.is_meta for layer in layers for t in layer.parameters())


def _old_form(entrypoint: str, kwargs: dict, seed: int, described: list[nn.Module], loss_fn: LossFn,
              vocab_size: int | None) -> LayeredModel:
    """``(layers, loss_fn)`` as a LayeredModel. ``described`` may live on the meta device; the
    first layer asked for builds the real model once (under its fixed seed) and keeps it.
    Parameters shared between layers become tied groups (runtime/shared_params.py)."""
    real: list[nn.Module] = []
    tied = shared_groups(described)

    def make_layer(index: int) -> nn.Module:
        if not real:
            whole = load_entrypoint_layers(entrypoint, kwargs, seed)[0] if _is_meta(described) else described
            real.extend(untie(whole, tied))
        return real[index]
    kinds = [_structure(layer) for layer in described]
    return LayeredModel(len(described), make_layer, loss_fn, vocab_size=vocab_size, layer_kind=kinds.__getitem__,
                        tied=tied)


def gpt_model(cfg: GPTConfig) -> LayeredModel:
    return LayeredModel(cfg.num_stage_layers, partial(make_gpt_layer, cfg), lm_loss, vocab_size=cfg.vocab_size,
                        layer_kind=partial(gpt_layer_kind, cfg))


def build_gpt_range(cfg: GPTConfig, start: int, end: int, seed: int) -> list[nn.Module]:
    """Layers [start, end) of the built-in GPT (the weights a whole build holds for them)."""
    return build_model_range(ModelSpec(gpt=cfg), start, end, seed).layers


def describe_model(spec: ModelSpec, seed: int) -> LayeredModel:
    """The model, with no weights allocated where its form allows it."""
    if spec.gpt is not None:
        return gpt_model(spec.gpt)
    try:  # an old-form entrypoint then builds its layers without memory; a LayeredModel costs nothing
        with torch.device("meta"):
            result = _call_entrypoint(spec.entrypoint, spec.kwargs, seed)
    except Exception:  # code that cannot run on meta (reads values, loads files): build it for real
        result = _call_entrypoint(spec.entrypoint, spec.kwargs, seed)
    if isinstance(result, LayeredModel):
        return result
    layers, loss_fn = _checked_pair(spec.entrypoint, result)
    vocab_size = spec.kwargs.get("vocab_size")
    return _old_form(spec.entrypoint, spec.kwargs, seed, layers, loss_fn,
                     vocab_size if isinstance(vocab_size, int) else None)


def build_layer(model: LayeredModel, index: int, seed: int) -> nn.Module:
    """Allocate and initialise layer ``index`` alone, from the CPU RNG seeded by (seed, index)."""
    _check_range(index, index + 1, model.num_layers)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(layer_seed(seed, index))
        layer = model.make_layer(index)
    if not isinstance(layer, nn.Module):
        raise TypeError(f"make_layer({index}) returned {type(layer).__name__}, not an nn.Module")
    if any(t.is_meta for t in layer.parameters()) or any(t.is_meta for t in layer.buffers()):
        raise ValueError(f"make_layer({index}) returned a layer with tensors on the meta device; "
                         "it must allocate them (e.g. to_empty(device='cpu') and initialise)")
    return layer


def layer_kind(model: LayeredModel, index: int) -> Hashable | None:
    """Equal for layers that cost the same to run; None when the structure cannot be read."""
    if model.layer_kind is not None:
        return ("kind", model.layer_kind(index))
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            return _structure(model.make_layer(index))
    except Exception:  # a factory that cannot build on meta is profiled layer by layer
        return None


def count_layers(spec: ModelSpec) -> int:
    """The model's depth, without allocating it where its form allows (see describe_model)."""
    return describe_model(spec, seed=0).num_layers


@dataclass
class ModelBundle:
    layers: list[nn.Module]  # only the requested contiguous range [start, end)
    loss_fn: LossFn
    num_layers: int  # total layers in the full model
    vocab_size: int | None = None  # token ids the first layer takes, where the model says
    tied: tuple[tuple[str, ...], ...] = ()  # LayeredModel.tied


def build_model_range(spec: ModelSpec, start: int, end: int, seed: int) -> ModelBundle:
    """Layers [start, end) of the model, and nothing else allocated (the old entrypoint form
    builds the whole model and keeps the slice)."""
    model = describe_model(spec, seed)
    _check_range(start, end, model.num_layers)
    return ModelBundle([build_layer(model, i, seed) for i in range(start, end)], model.loss_fn, model.num_layers,
                       model.vocab_size, model.tied)
