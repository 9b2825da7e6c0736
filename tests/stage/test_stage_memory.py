"""A stage allocates only its own layers, and profiling never holds the whole model.

Each measurement runs in a fresh process: the peak resident memory (the kernel's high-water
mark) of building a stage, less what the process held before, against the bytes the whole
model's parameters need (which a whole-model build cannot go below)."""

import json
import subprocess
import sys

import pytest
import torch

from hetlaunch.runtime.model import build_layer, build_model_range, count_layers, describe_model
from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec

from conftest import TESTS_DIR

# 24 layers, ~1 GB of fp32 weights: 22 residual MLP blocks of ~42 MB between a small embedding and head.
BIG = {"vocab_size": 256, "d": 1152, "n_hidden": 22, "seq_len": 16, "hidden_mult": 4}

def whole_model_param_bytes(kwargs: dict) -> int:
    sys.path.insert(0, str(TESTS_DIR))
    try:
        model = describe_model(ModelSpec(entrypoint="user_model:make_layered_mlp_lm", kwargs=kwargs), seed=0)
        total = 0
        for i in range(model.num_layers):
            with torch.device("meta"):
                total += sum(p.numel() * p.element_size() for p in model.make_layer(i).parameters())
        return total
    finally:
        sys.path.remove(str(TESTS_DIR))


def measure(what: str) -> dict:
    """peak_memory.py in a fresh process: a stage holding layer 5, or profiling the model."""
    start, end = (5, 6) if what == "stage" else (-1, -1)
    out = subprocess.run([sys.executable, str(TESTS_DIR / "peak_memory.py"), "user_model:make_layered_mlp_lm",
                          json.dumps(BIG), str(start), str(end)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return {"peak": data["peak_bytes"], "params": data["param_bytes"]}


@pytest.fixture
def user_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def test_a_stage_of_one_layer_in_24_holds_a_small_part_of_a_1gb_model():
    whole = whole_model_param_bytes(BIG)
    assert whole > 0.9e9  # the model the claim is about
    stage = measure("stage")
    assert stage["params"] * 20 < whole  # it holds one block
    assert stage["peak"] < whole / 4, (stage, whole)


def test_profiling_a_1gb_model_never_holds_the_whole_model():
    whole = whole_model_param_bytes(BIG)
    profile = measure("profile")
    # One block at a time with its gradients and AdamW state (and the optimizer's temporaries):
    # far below the whole model's weights alone, let alone their training state.
    assert profile["peak"] < whole / 2, (profile, whole)


def test_count_and_profile_build_each_kind_of_layer_once(user_path):
    import user_model
    from hetlaunch.runtime.node_measurement import profile_layers

    spec = ModelSpec(entrypoint="user_model:make_layered_mlp_lm", kwargs={"d": 16, "n_hidden": 5, "seq_len": 8})
    user_model.BUILT_LAYERS.clear()
    assert count_layers(spec) == 7
    assert user_model.BUILT_LAYERS == []  # the depth is read from the description
    measured = profile_layers(spec, micro_batch_size=2, device=torch.device("cpu"), warmup=0, repeats=1)
    assert len(measured) == 7
    real = [index for index, device in user_model.BUILT_LAYERS if device != "meta"]
    assert real == [0, 1, 6]  # embedding, one block (the other four are the same kind), head
    assert len({(m.seconds, m.param_bytes) for m in measured[1:6]}) == 1


def test_any_cut_of_a_layered_model_has_the_same_weights(user_path):
    spec = ModelSpec(entrypoint="user_model:make_layered_mlp_lm", kwargs={"d": 16, "n_hidden": 3, "seq_len": 8})
    whole = build_model_range(spec, 0, 5, seed=3).layers
    parts = build_model_range(spec, 0, 2, seed=3).layers + build_model_range(spec, 2, 5, seed=3).layers
    for a, b in zip(whole, parts):
        for x, y in zip(a.state_dict().values(), b.state_dict().values()):
            assert torch.equal(x, y)
    # Layers of one kind still get their own weights (seeded per index, not per kind).
    assert not torch.equal(whole[1].fc.weight, whole[2].fc.weight)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_model_range(spec, 1, 3, seed=3)
    assert torch.equal(torch.rand(3), expected)  # the caller's RNG is untouched


def test_the_old_form_is_counted_without_building_it(user_path):
    import user_model

    calls = []
    original = user_model.ResidualMLP.__init__

    def spy(self, *args, **kwargs):
        calls.append(str(torch.get_default_device()))
        original(self, *args, **kwargs)

    user_model.ResidualMLP.__init__ = spy
    try:
        assert count_layers(ModelSpec(entrypoint="user_model:make_mlp_lm", kwargs={"d": 8, "seq_len": 8})) == 5
    finally:
        user_model.ResidualMLP.__init__ = original
    assert calls == ["meta"] * 3


def test_a_factory_that_leaves_meta_tensors_is_one_clear_error():
    from hetlaunch.runtime.model import LayeredModel

    def on_meta(index):
        with torch.device("meta"):
            return torch.nn.Linear(2, 2)
    model = LayeredModel(2, on_meta, lambda out, targets: out.sum())
    with pytest.raises(ValueError, match=r"make_layer\(0\).*meta device"):
        build_layer(model, 0, seed=0)


def test_gpt_layers_are_built_once_and_keep_their_weights():
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
    a = build_model_range(ModelSpec(gpt=cfg), 1, 2, seed=0).layers[0]
    b = build_model_range(ModelSpec(gpt=cfg), 0, 4, seed=0).layers[1]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.fc.weight.std().item() == pytest.approx(0.02, rel=0.2)
