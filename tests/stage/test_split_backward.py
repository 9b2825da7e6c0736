"""A backward split into I (the input's gradient) and W (the weights'), runtime/split_backward.py:
the same gradients as one full backward, bit for bit, on every kind of stage of the built-in GPT;
graphs that cannot be split are run whole by I; the executor runs I and W actions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetlaunch.runtime.actions import parse_actions
from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
from hetlaunch.runtime.split_backward import SplitBackward

SPEC = ModelSpec(gpt=GPTConfig(seq_len=16, d_model=32, n_layers=4, n_heads=4))
NUM_LAYERS = 6  # embedding, four blocks, head (runtime/gpt.py)


def _backwards(start: int, end: int, split: bool, microbatches: int = 2):
    """The input gradients and the summed weight gradients of `microbatches` backwards through
    layers [start, end), full or split (every I first, then every W, as a schedule may order them)."""
    bundle = build_model_range(SPEC, start, end, seed=0)
    stage = nn.Sequential(*bundle.layers)
    generator = torch.Generator().manual_seed(1)
    kept, input_grads = [], []
    for _ in range(microbatches):
        if start == 0:
            x = torch.randint(0, 256, (2, 16), generator=generator)
        else:
            x = torch.randn(2, 16, 32, generator=generator, requires_grad=True)
        y = stage(x)
        if end == bundle.num_layers:
            out, grad = bundle.loss_fn(y, torch.randint(0, 256, (2, 16), generator=generator)), None
        else:
            out, grad = y, torch.randn(y.shape, generator=generator)
        inputs = [] if start == 0 else [x]
        if split:
            backward = SplitBackward([out], [grad], inputs, list(stage.parameters()))
            assert not backward.whole_in_input_pass
            input_grads.append(backward.input_grads())
            kept.append(backward)
        else:
            torch.autograd.backward([out], [grad])
            input_grads.append([x.grad] if inputs else [])
    for backward in kept:
        backward.weight_grads()
    return input_grads, {name: p.grad for name, p in stage.named_parameters()}


@pytest.mark.parametrize("start, end", [(0, 2), (2, 4), (4, NUM_LAYERS), (1, 5), (0, NUM_LAYERS)],
                         ids=["first", "middle", "last", "blocks", "whole"])
def test_i_then_w_gives_the_full_backwards_gradients_bit_for_bit(start, end):
    full_inputs, full_params = _backwards(start, end, split=False)
    split_inputs, split_params = _backwards(start, end, split=True)
    for full, split in zip(full_inputs, split_inputs):
        assert len(full) == len(split) and all(torch.equal(a, b) for a, b in zip(full, split))
    assert full_params.keys() == split_params.keys()
    for name, grad in full_params.items():
        assert grad is not None and torch.equal(grad, split_params[name]), name


def test_i_alone_leaves_the_weights_untouched_and_w_fills_them():
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    backward = SplitBackward([layer(x).square().sum()], [None], [x], list(layer.parameters()))
    (grad,) = backward.input_grads()
    assert grad is not None and layer.weight.grad is None and layer.bias.grad is None
    backward.weight_grads()
    assert layer.weight.grad is not None and layer.bias.grad is not None
    with pytest.raises(RuntimeError, match="ran twice"):
        backward.input_grads()


@pytest.mark.parametrize("build", ["twice_along_one_path", "output_without_the_input"])
def test_a_graph_that_cannot_be_split_runs_whole_in_i_and_stays_exact(build):
    """A weight used twice along the input's path (seeding both uses would count the second
    twice), or an output that depends on a weight but not on the input: I runs it all."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def outputs(inp):
        if build == "twice_along_one_path":
            return [layer(torch.tanh(layer(inp))).sum()]
        return [layer(inp).sum(), layer.weight.square().sum()]

    full_x = x.clone().requires_grad_()
    torch.autograd.backward(outputs(full_x))
    want = (full_x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    layer.zero_grad(set_to_none=True)
    split_x = x.clone().requires_grad_()
    outs = outputs(split_x)
    backward = SplitBackward(outs, [None] * len(outs), [split_x], list(layer.parameters()))
    assert backward.whole_in_input_pass
    (grad,) = backward.input_grads()
    backward.weight_grads()  # nothing left to do
    assert torch.equal(grad, want[0]) and torch.equal(layer.weight.grad, want[1]) and torch.equal(layer.bias.grad, want[2])


def test_the_executor_runs_split_backwards_like_full_ones():
    """One stage (first and last): a step of F F I I W W equals a step of F B F B, bit for bit."""
    def step(actions: str):
        torch.manual_seed(0)
        stage = StageExecutor([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)], lambda out, y: (out - y).pow(2).mean(),
                              is_first=True, is_last=True, device=torch.device("cpu"))
        data = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(2)]
        result = stage.train_step(parse_actions(actions, 0), data, 2)
        return result.loss, [p.detach().clone() for p in stage.module.parameters()]

    loss, params = step("F0 B0 F1 B1")
    split_loss, split_params = step("F0 F1 I0 I1 W0 W1")
    assert loss == split_loss and all(torch.equal(a, b) for a, b in zip(params, split_params))
    with pytest.raises(RuntimeError, match="without their weight gradients"):
        step("F0 F1 I0 I1 W0")
