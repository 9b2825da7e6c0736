"""GradientSync in one process (a real gloo group of one rank): buckets start during the backward.

The multi-process behaviour (sums across holders, identical replicas) is covered end to end
by test_data_parallel.py; here the timing: a bucket's reduction must be launched as soon as
its gradients are final, while the backward is still running lower layers, as DDP does.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import run_gloo_ranks
from hetlaunch.runtime import grad_sync
from hetlaunch.runtime.codecs import codec_by_name
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.grad_sync import GradientSync, SyncGroupPlan, make_groups


@pytest.fixture
def one_rank_group():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _layers(n: int, width: int = 64) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(width, width) for _ in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_buckets_launch_during_backward_in_backward_order(one_rank_group, monkeypatch, codec):
    # One Linear layer (64x64 + 64 floats, 16.6 KB) per bucket.
    monkeypatch.setattr(grad_sync, "BUCKET_BYTES", 20_000)
    layers = _layers(4)
    # Two groups: layers 10-11 and 12-13 of the model (this stage holds 10-13).
    plans = [SyncGroupPlan(10, 12, (0,), codec_by_name(codec)), SyncGroupPlan(12, 14, (0,), codec_by_name(codec))]
    sync = GradientSync(layers, 10, plans, make_groups(plans), torch.device("cpu"))
    assert len(sync.buckets) == 4
    assert [b.params[0] is layers[3].bias for b in sync.buckets] == [True, False, False, False]

    launched_when_first_layer_runs = []
    model = nn.Sequential(*layers)
    x = torch.randn(8, 64, requires_grad=True)
    # The gradient of layer 0's output is ready before layer 0's own backward has run.
    hidden = layers[0](x)
    hidden.register_hook(lambda g: launched_when_first_layer_runs.append(len(sync._launched)))
    out = nn.Sequential(*layers[1:])(hidden)
    sync.arm()
    out.square().mean().backward()
    # When the backward reached layer 0, the buckets of layers 3 and 2 (and maybe 1: autograd may
    # accumulate layer 1's weights just after passing its input gradient on) were on their way.
    assert len(launched_when_first_layer_runs) == 1 and 2 <= launched_when_first_layer_runs[0] <= 3
    assert [id(b) for b in sync._launched] == [id(b) for b in sync.buckets]  # backward order, each once
    reference = [p.grad.clone() for p in model.parameters()]
    sync.finish()
    if codec == "none":  # one rank: the sum is the gradient itself, written back in place
        for got, want in zip((p.grad for p in model.parameters()), reference):
            assert torch.equal(got, want)


@pytest.mark.timeout(60)
def test_a_rank_with_several_stages_finds_its_layers_by_index_and_arms_each_stage_alone(one_rank_group):
    """A node running two stages of a pipeline holds layers 2-3 and 10-11 of the model (as ZB-V's
    first device does): its sync groups find their layers by model index, a group it does not hold
    is refused, and arming one stage's parameters launches that stage's buckets only, during its
    backward, while the other's wait for their own arming (or `finish`)."""
    layers = _layers(4)
    local_of = {2: 0, 3: 1, 10: 2, 11: 3}
    plans = [SyncGroupPlan(2, 4, (0,), codec_by_name("none")), SyncGroupPlan(10, 12, (0,), codec_by_name("none"))]
    sync = GradientSync(layers, 0, plans, make_groups(plans), torch.device("cpu"), local_index=local_of.__getitem__)
    assert [b.plan.layer_start for b in sync.buckets] == [10, 2]  # backward order, by model index
    with pytest.raises(ValueError, match="does not hold layer 4"):
        missing = [SyncGroupPlan(3, 5, (0,), codec_by_name("none"))]
        GradientSync(layers, 0, missing, make_groups(missing), torch.device("cpu"), local_index=local_of.__getitem__)
    later = {id(p) for layer in layers[2:] for p in layer.parameters()}  # the stage holding 10-11
    sync.arm(later)
    nn.Sequential(*layers)(torch.randn(8, 64)).square().mean().backward()
    assert [b.plan.layer_start for b in sync._launched] == [10]  # the other stage's wait
    sync.finish()
    assert sorted(b.plan.layer_start for b in sync._launched) == [2, 10]


@pytest.mark.timeout(60)
def test_error_feedback_carries_what_the_codec_lost(one_rank_group):
    """With int8, a gradient below a block's quantisation step is lost in one step but comes
    back through the carried error: summed over steps, the synced gradients track the true ones."""
    layer = nn.Linear(64, 1, bias=False)
    plans = [SyncGroupPlan(0, 1, (0,), codec_by_name("int8"))]
    sync = GradientSync([layer], 0, plans, make_groups(plans), torch.device("cpu"))
    true = torch.full((1, 64), 1e-4)
    true[0, 0] = 1.0  # one large value sets the block's scale: 1e-4 is under half a step (1/127)
    synced_total = torch.zeros_like(true)
    for _ in range(100):
        layer.weight.grad = None
        sync.arm()
        layer.weight.grad = true.clone()
        sync.finish()
        synced_total += layer.weight.grad
    # Without feedback every step would round 1e-4 to 0. With it the carried error never exceeds
    # one quantisation step, so the running sums differ by less than that step (1/127 here).
    step = 1.0 / 127
    assert synced_total[0, 1].item() > 0
    assert abs(synced_total[0, 1].item() - 100 * 1e-4) <= step + 1e-6
    assert torch.allclose(synced_total, 100 * true, atol=step + 1e-6)


def _emulated_rank(rank: int, out_dir: str) -> None:
    layer = nn.Linear(25_000, 1, bias=False)  # 100 kB of gradient
    # 8 Mbps = 1 MB/s; a 2-holder ring moves 2(k-1)/k = all 100 kB: 0.1 s, plus 2 hops x 10 ms.
    plans = [SyncGroupPlan(0, 1, (0, 1), codec_by_name("none"), WireEmulation.from_spec(8, 20))]
    sync = GradientSync([layer], 0, plans, make_groups(plans), torch.device("cpu"))
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)  # the second holder finishes its backward later
    sync.arm()
    launched = time.time()
    layer.weight.grad = torch.full_like(layer.weight, float(rank + 1))
    sync._hook(sync.buckets[0])(layer.weight)
    sync.finish()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"launched": launched, "done": time.time(), "sum": layer.weight.grad.unique().tolist()}))


@pytest.mark.timeout(90)
def test_emulated_sync_starts_when_the_last_holder_joins(tmp_path):
    """Over an emulated link the sync takes its wire time from when the *last* holder launched
    (not each holder's own launch), so an early holder waits for the late one plus the transfer."""
    run_gloo_ranks(_emulated_rank, 2, tmp_path)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(run["sum"] == [3.0] for run in runs)  # 1 + 2 on both holders
    last_launch = max(run["launched"] for run in runs)
    for run in runs:
        assert run["done"] >= last_launch + 0.12 - 0.005  # 0.1 s on the wire + 2 x 10 ms latency
        assert run["done"] <= last_launch + 1.0
