"""Built-in GPT and user entrypoints: any contiguous layer range reproduces the full model."""

import math

import pytest
import torch
from torch import nn

from hetlaunch.runtime.gpt import Block, Embedding, Head
from hetlaunch.runtime.model import (
    ModelBundle,
    build_gpt_range,
    build_model_range,
    count_layers,
    lm_loss,
    load_entrypoint_layers,
)
from hetlaunch.runtime.model_spec import PRESETS, GPTConfig, ModelSpec, preset

from conftest import TESTS_DIR

torch.set_num_threads(1)

CFG = GPTConfig(vocab_size=256, seq_len=16, d_model=32, n_layers=3, n_heads=4)
USER_EP = "user_model:make_mlp_lm"


@pytest.fixture
def user_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def run_chain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def tokens(b=2, t=16, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def flat_state(layers):
    return [t for layer in layers for t in layer.state_dict().values()]


def test_presets_and_layer_count():
    assert PRESETS["tiny"] == GPTConfig(seq_len=64, d_model=64, n_layers=4, n_heads=4)
    assert (PRESETS["small"].d_model, PRESETS["small"].n_layers, PRESETS["small"].seq_len) == (128, 6, 128)
    assert PRESETS["tiny"].num_stage_layers == 6
    assert PRESETS["tiny"].ff_dim == 256
    assert preset("small") is PRESETS["small"]
    with pytest.raises(ValueError, match="tiny"):
        preset("huge")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(d_model=30, n_heads=4)


def test_layer_types_and_shapes():
    layers = build_gpt_range(CFG, 0, CFG.num_stage_layers, seed=1)
    assert isinstance(layers[0], Embedding) and isinstance(layers[-1], Head)
    assert all(isinstance(layer, Block) for layer in layers[1:-1])
    x = tokens()
    h = layers[0](x)
    assert h.shape == (2, 16, 32) and h.dtype == torch.float32
    assert layers[1](h).shape == h.shape
    assert layers[-1](h).shape == (2, 16, 256)
    with pytest.raises(ValueError, match="seq_len"):
        layers[0](tokens(t=17))


def test_gpt_ranges_match_full_model_bitwise():
    n = CFG.num_stage_layers
    full = build_gpt_range(CFG, 0, n, seed=7)
    parts = build_gpt_range(CFG, 0, 2, seed=7) + build_gpt_range(CFG, 2, n, seed=7)
    middle = build_gpt_range(CFG, 2, 4, seed=7)
    for a, b in zip(flat_state(full), flat_state(parts)):
        assert torch.equal(a, b)
    for a, b in zip(flat_state(full[2:4]), flat_state(middle)):
        assert torch.equal(a, b)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(run_chain(full, x), run_chain(parts, x))


def test_gpt_staged_backward_matches_full():
    """Cutting the graph at a stage boundary (as the executor does) gives the same gradients."""
    n = CFG.num_stage_layers
    full = build_gpt_range(CFG, 0, n, seed=3)
    first, second = build_gpt_range(CFG, 0, 2, seed=3), build_gpt_range(CFG, 2, n, seed=3)
    x, y = tokens(seed=1), tokens(seed=2)
    lm_loss(run_chain(full, x), y).backward()

    boundary = run_chain(first, x)
    received = boundary.detach().requires_grad_()
    loss = lm_loss(run_chain(second, received), y)
    loss.backward()
    boundary.backward(received.grad)
    for a, b in zip(full, first + second):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=1e-6)


def test_gpt_init_statistics_and_seed():
    layers = build_gpt_range(PRESETS["tiny"], 0, 2, seed=0)
    block = layers[1]
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    resid = 0.02 / math.sqrt(2 * PRESETS["tiny"].n_layers)
    assert block.attn.proj.weight.std().item() == pytest.approx(resid, rel=0.1)
    assert block.proj.weight.std().item() == pytest.approx(resid, rel=0.1)
    assert torch.count_nonzero(block.fc.bias) == 0
    assert torch.equal(block.ln1.weight, torch.ones(64))
    other = build_gpt_range(PRESETS["tiny"], 1, 2, seed=1)[0]
    assert not torch.equal(other.fc.weight, block.fc.weight)
    # Different layers of the same seed are not copies of each other.
    block2 = build_gpt_range(PRESETS["tiny"], 2, 3, seed=0)[0]
    assert not torch.equal(block2.fc.weight, block.fc.weight)


def test_building_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_gpt_range(CFG, 0, 3, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_gpt_loss_at_init_is_near_uniform():
    cfg = PRESETS["tiny"]
    layers = build_gpt_range(cfg, 0, cfg.num_stage_layers, seed=0)
    x, y = tokens(b=4, t=64, seed=1), tokens(b=4, t=64, seed=2)
    with torch.no_grad():
        loss = lm_loss(run_chain(layers, x), y)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_build_model_range_gpt_and_errors():
    spec = ModelSpec(gpt=CFG)
    assert count_layers(spec) == 5 and spec.seq_len == 16
    bundle = build_model_range(spec, 1, 4, seed=0)
    assert isinstance(bundle, ModelBundle)
    assert len(bundle.layers) == 3 and bundle.num_layers == 5 and bundle.loss_fn is lm_loss
    for start, end in [(-1, 2), (2, 2), (3, 1), (0, 6)]:
        with pytest.raises(ValueError, match="layer range"):
            build_model_range(spec, start, end, seed=0)


def test_model_spec_validation():
    with pytest.raises(ValueError, match="exactly one"):
        ModelSpec()
    with pytest.raises(ValueError, match="exactly one"):
        ModelSpec(gpt=CFG, entrypoint=USER_EP)
    with pytest.raises(ValueError, match="kwargs"):
        ModelSpec(gpt=CFG, kwargs={"d": 3})
    with pytest.raises(ValueError, match="seq_len"):
        ModelSpec(entrypoint=USER_EP).seq_len
    assert ModelSpec(entrypoint=USER_EP, kwargs={"seq_len": 16}).seq_len == 16


def test_entrypoint_ranges_match_full_model(user_path):
    kwargs = {"d": 16, "n_hidden": 3, "seq_len": 16}
    spec = ModelSpec(entrypoint=USER_EP, kwargs=kwargs)
    assert count_layers(spec) == 5
    full = build_model_range(spec, 0, 5, seed=11)
    first, second = build_model_range(spec, 0, 2, seed=11), build_model_range(spec, 2, 5, seed=11)
    assert (len(first.layers), len(second.layers), first.num_layers) == (2, 3, 5)
    for a, b in zip(flat_state(full.layers), flat_state(first.layers + second.layers)):
        assert torch.equal(a, b)
    x, y = tokens(), tokens(seed=1)
    with torch.no_grad():
        out = run_chain(full.layers, x)
        assert torch.equal(out, run_chain(second.layers, run_chain(first.layers, x)))
    loss = full.loss_fn(out, y)
    assert loss.shape == () and math.isfinite(loss.item())
    other_seed = build_model_range(spec, 0, 1, seed=12)
    assert not torch.equal(other_seed.layers[0].emb.weight, full.layers[0].emb.weight)


def test_entrypoint_loader_seeds_without_touching_global_rng(user_path):
    torch.manual_seed(99)
    expected = torch.rand(2)
    torch.manual_seed(99)
    layers, loss_fn = load_entrypoint_layers(USER_EP, {"d": 8}, seed=0)
    assert torch.equal(torch.rand(2), expected)
    assert all(isinstance(m, nn.Module) for m in layers) and callable(loss_fn)


@pytest.mark.parametrize("bad", ["user_model", "user_model:", ":make_mlp_lm", "a b:c", "user_model:f()", "x..y:f"])
def test_entrypoint_bad_format(bad):
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        load_entrypoint_layers(bad, {}, seed=0)


def test_entrypoint_missing_module_or_attribute(user_path):
    with pytest.raises(ValueError, match="no_such_module_hetlaunch.*cannot import"):
        load_entrypoint_layers("no_such_module_hetlaunch:f", {}, seed=0)
    with pytest.raises(ValueError, match="user_model:nope.*no attribute 'nope'"):
        load_entrypoint_layers("user_model:nope", {}, seed=0)
    with pytest.raises(ValueError, match="not callable"):
        load_entrypoint_layers("user_model:NOT_CALLABLE", {}, seed=0)


@pytest.mark.parametrize("func", ["returns_module", "returns_bad_layers", "returns_bad_loss"])
def test_entrypoint_wrong_return_shape(user_path, func):
    with pytest.raises(TypeError, match=r"must return a .*LayeredModel or \(layers, loss_fn\)"):
        load_entrypoint_layers(f"user_model:{func}", {}, seed=0)
