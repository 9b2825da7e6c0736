"""Stage boundaries that carry a tuple of tensors: every element crosses a real gloo link in
its own dtype (complex as a real view; integers and booleans exact under a lossy codec), and a
model whose boundaries carry (hidden, mask) trains across three stages as one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import TESTS_DIR, final_parameters, run_gloo_ranks, run_hetlaunch
from hetlaunch.runtime.data import TokenBatches, stdlib_text_bytes
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import ModelSpec



def _message():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 64, generator=g), torch.rand(4, 64, generator=g) > 0.5,
            torch.randint(-5, 2**40, (7,), generator=g), torch.randn(3, 5, dtype=torch.complex64, generator=g),
            torch.randn(2, 2, generator=g).to(torch.bfloat16))


def _tuple_rank(rank: int, out_dir: str) -> None:
    from hetlaunch.runtime.codecs import CODECS_BY_NAME
    from hetlaunch.runtime.link import Link

    cpu = torch.device("cpu")
    for codec in ("none", "int8"):
        link = Link(1 - rank, CODECS_BY_NAME[codec], cpu, cpu)
        if rank == 0:
            link.send(_message())
            link.send(_message()[0])  # a lone tensor after a tuple
            link.drain()
        else:
            got, lone = link.recv(), link.recv()
            want = _message()
            assert isinstance(got, tuple) and len(got) == 5 and isinstance(lone, torch.Tensor)
            assert [t.dtype for t in got] == [t.dtype for t in want]
            assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # never lossy
            if codec == "none":
                assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(lone, want[0])
            else:
                assert torch.allclose(got[0], want[0], atol=0.05) and not torch.equal(got[0], want[0])
                assert torch.allclose(got[3], want[3], atol=0.05)


def test_a_tuple_crosses_a_link_element_by_element(tmp_path):
    run_gloo_ranks(_tuple_rank, 2, tmp_path)


KW = {"d": 32, "n_hidden": 3, "seq_len": 16}
SEED, DATA_SEED, STEPS = 4, 6, 6


def reference() -> tuple[list[float], dict]:
    spec = ModelSpec(entrypoint="user_model:make_masked_lm", kwargs=KW)
    bundle = build_model_range(spec, 0, 5, seed=SEED)
    net = nn.Sequential(*bundle.layers)
    optimizer = torch.optim.AdamW([{"params": [p for p in net.parameters() if p.dim() >= 2]},
                                   {"params": [p for p in net.parameters() if p.dim() < 2]}], lr=3e-3, weight_decay=0.0)
    batches = TokenBatches(stdlib_text_bytes(), 16, seed=DATA_SEED)
    losses = []
    for step in range(STEPS):
        step_losses = []
        for x, y in batches.micro_batches(step, 2, 4):
            loss = bundle.loss_fn(net(x), y)
            (loss / 4).backward()
            step_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(step_losses) / 4)
    return losses, {f"layers.{k}": v.detach() for k, v in net.state_dict().items()}


@pytest.mark.timeout(240)
def test_hidden_and_mask_boundaries_train_as_one_process(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    (tmp_path / "cluster.yaml").write_text(f"""name: tuples
model: {{entrypoint: "user_model:make_masked_lm", kwargs: {json.dumps(KW)}}}
data: {{seed: {DATA_SEED}}}
train: {{steps: {STEPS}, micro_batch_size: 2, num_microbatches: 4, seed: {SEED}}}
compression: {{intra_region: none, cross_region: none}}
nodes:
  - {{name: a, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: b, device: cpu, threads: 1, layers: [2, 3]}}
  - {{name: c, device: cpu, threads: 1, layers: [3, 5]}}
""")
    result = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "run"), timeout=200)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    want, params = reference()
    for got, w in zip((r["loss"] for r in lines), want):
        assert abs(got - w) / w <= 1e-5, ([r["loss"] for r in lines], want)
    merged = final_parameters(tmp_path / "run")
    for name, value in params.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Both elements crossed each boundary: the hidden state (floats) and the mask (one byte each).
    stage = lines[0]["stages"][0]
    assert stage["sent_bytes"]["forward"][0] == 4 * 2 * 16 * (32 * 4 + 1)


def test_profiling_sizes_every_element_of_a_tuple_boundary(monkeypatch):
    from hetlaunch.runtime.node_measurement import profile_layers

    monkeypatch.syspath_prepend(str(TESTS_DIR))
    spec = ModelSpec(entrypoint="user_model:make_masked_lm", kwargs=KW)
    measured = profile_layers(spec, 2, torch.device("cpu"), warmup=0, repeats=1)
    assert [m.output_bytes for m in measured[:-1]] == [2 * 16 * (32 * 4 + 1)] * 4  # hidden fp32 + bool mask
    assert all(m.seconds > 0 for m in measured)
