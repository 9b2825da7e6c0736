"""bf16 on links, rounded stochastically (runtime/wire_rounding.py): unbiased where rounding to
nearest is not, exact where the value is already bf16, the same bits again from the same seed,
and applied to the gradient going back as to the activation going forward."""

from __future__ import annotations

import pytest
import torch

from hetlaunch.runtime.wire_rounding import WireRounding, stochastic_bf16

CPU = torch.device("cpu")


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    # 1 + 2^-10 lies an eighth of the way from bf16's 1.0 to its next value 1 + 2^-7: nearest always
    # gives 1.0; stochastic gives 1 + 2^-7 an eighth of the time, so the mean is the fp32 value.
    x = torch.full((400_000,), 1.0 + 2**-10)
    y = stochastic_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(y.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert y.mean().item() == pytest.approx(1.0 + 2**-10, abs=2**-7 * 0.01)
    assert x.to(torch.bfloat16).float().mean().item() == 1.0
    negative = stochastic_bf16(-x, torch.Generator().manual_seed(0)).float()
    assert negative.mean().item() == pytest.approx(-(1.0 + 2**-10), abs=2**-7 * 0.01)


def test_values_bf16_holds_stay_exact_and_infinities_stay_infinite():
    exact = torch.tensor([0.0, -0.0, 1.5, -3.0, 2.0**100, float("inf"), float("-inf")])
    got = stochastic_bf16(exact, torch.Generator().manual_seed(1))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), exact)
    assert torch.isnan(stochastic_bf16(torch.tensor([float("nan")]), torch.Generator().manual_seed(1))).all()


def test_the_same_seed_rounds_the_same_way_and_the_gradient_going_back_is_rounded_too():
    def once(seed: int):
        sender, receiver = WireRounding(torch.bfloat16, "stochastic", CPU), WireRounding(torch.bfloat16, "stochastic", CPU)
        sender.reseed(seed)
        receiver.reseed(seed + 1)
        x = torch.linspace(-1, 1, 1000, requires_grad=True)
        wire = sender.send(x * 1.001)
        assert wire.dtype == torch.bfloat16
        received = wire.detach().requires_grad_()
        fp32 = receiver.receive(received)
        assert fp32.dtype == torch.float32 and torch.equal(fp32, wire.detach().float())
        (fp32 * (1.0 + 2**-10)).sum().backward()  # a gradient between two bf16 values
        assert received.grad.dtype == torch.bfloat16
        wire.backward(received.grad)
        return wire.detach(), received.grad, x.grad
    first, again = once(7), once(7)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert set(first[1].float().unique().tolist()) == {1.0, 1.0 + 2**-7}  # stochastic, not always 1.0
    assert not torch.equal(first[0], once(8)[0])


def test_nearest_and_fp16_round_to_nearest_and_a_bad_name_is_refused():
    x = torch.full((1000,), 1.0 + 2**-10)
    for dtype, mode in ((torch.bfloat16, "nearest"), (torch.float16, "stochastic")):
        rounding = WireRounding(dtype, mode, CPU)
        rounding.reseed(0)
        assert torch.equal(rounding.send(x), x.to(dtype))
    with pytest.raises(ValueError, match="unknown link rounding 'up'"):
        WireRounding(torch.bfloat16, "up", CPU)
