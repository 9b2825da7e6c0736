"""Hierarchical gradient sync across real gloo ranks: sum inside each region, exchange between the
regions' leaders, broadcast back (runtime/hierarchical_sync.py).

Five ranks in two regions, interleaved so a region's leader is not simply rank 0 of a block, and
a sixth rank that holds nothing (it must still make every group, in order). Each holder's gradient
is a multiple of its rank, so the exact sum is known; several buckets per step check that phases
never cross between buckets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import run_gloo_ranks
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime import grad_sync
from hetlaunch.runtime.codecs import codec_by_name
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.grad_sync import GradientSync, SyncGroupPlan, make_groups, sync_group_plans
from hetlaunch.runtime.hierarchical_sync import region_members
from hetlaunch.runtime.wire import codec_wire_id

HOLDERS = (0, 1, 2, 3, 4)
REGIONS = (0, 1, 0, 1, 1)  # leaders: rank 0 (region 0) and rank 1 (region 1)
STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


def _holder(rank: int, out_dir: str, codec: str) -> None:
    grad_sync.BUCKET_BYTES = 5_000  # one Linear (4.2 kB) per bucket: four buckets
    torch.set_num_threads(1)
    model = _model()
    plans = [SyncGroupPlan(0, 4, HOLDERS, codec_by_name(codec), regions=REGIONS)]
    groups = make_groups(plans)
    if rank not in HOLDERS:
        assert groups == [None]
        dist.barrier()
        return
    sync = GradientSync(list(model), 0, plans, groups, torch.device("cpu"))
    assert len(sync.buckets) == 4
    torch.manual_seed(1 + rank)
    got, sent = [], []
    for step in range(STEPS):
        for p in model.parameters():
            p.grad = None
        x = torch.randn(8, 32)
        sync.arm()
        if rank == 3:
            time.sleep(0.05)  # a late holder: the others' phases must wait for it, not skip it
        model(x).square().mean().backward()
        mine = [p.grad.clone() for p in model.parameters()]
        stats = sync.finish()
        got.append([p.grad.flatten().tolist() for p in model.parameters()])
        sent.append([g.flatten().tolist() for g in mine])
        assert stats.raw_bytes == sum(p.numel() * 4 for p in model.parameters())
    dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"got": got, "sent": sent}))


def _results(tmp_path: Path, codec: str) -> list[dict]:
    run_gloo_ranks(_holder, 6, tmp_path, timeout_s=90, args=(codec,))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in HOLDERS]


@pytest.mark.timeout(120)
def test_every_holder_ends_with_the_exact_sum(tmp_path):
    runs = _results(tmp_path, "none")
    for step in range(STEPS):
        for index in range(8):  # 4 layers x (weight, bias)
            want = torch.tensor([run["sent"][step][index] for run in runs], dtype=torch.float64).sum(0)
            for run in runs:
                got = torch.tensor(run["got"][step][index], dtype=torch.float64)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            # Bit-identical on every holder: the leaders' total, broadcast.
            assert all(run["got"][step][index] == runs[0]["got"][step][index] for run in runs)


@pytest.mark.timeout(120)
def test_a_lossy_codec_is_applied_between_leaders_with_error_feedback(tmp_path):
    runs = _results(tmp_path, "int8")
    for index in range(8):
        sent = sum(torch.tensor(run["sent"][s][index]) for run in runs for s in range(STEPS))
        got = torch.tensor(runs[0]["got"][0][index])
        for s in range(STEPS):
            assert all(run["got"][s][index] == runs[0]["got"][s][index] for run in runs)
        got = sum(torch.tensor(runs[0]["got"][s][index]) for s in range(STEPS))
        # Summed over the steps, what the codec lost is carried forward: the error left is at most
        # one step's quantisation of each region's sum, far below the gradients themselves.
        assert (got - sent).abs().max() <= 0.02 * sent.abs().max() + 1e-6


def _emulated(rank: int, out_dir: str) -> None:
    layer = nn.Linear(25_000, 1, bias=False)  # 100 kB of gradient
    # 8 Mbps = 1 MB/s between the two leaders: a 2-member ring moves all 100 kB, 0.1 s, + 40 ms.
    plans = [SyncGroupPlan(0, 1, (0, 1, 2, 3), codec_by_name("none"), WireEmulation.from_spec(8, 40),
                           regions=(0, 0, 1, 1))]
    sync = GradientSync([layer], 0, plans, make_groups(plans), torch.device("cpu"))
    dist.barrier()
    if rank == 3:
        time.sleep(0.3)  # region 1's sum is late: the slow exchange starts after it
    sync.arm()
    launched = time.time()
    layer.weight.grad = torch.full_like(layer.weight, float(rank + 1))
    sync._hook(sync.buckets[0])(layer.weight)
    sync.finish()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"launched": launched, "done": time.time(), "sum": layer.weight.grad.unique().tolist()}))


@pytest.mark.timeout(120)
def test_the_leaders_exchange_takes_the_emulated_slow_link_from_the_last_launch(tmp_path):
    """Every holder, in both regions, waits for the leaders' exchange over the emulated link, which
    starts when the last region's sum is ready (a lower bound only: an upper one would be timing)."""
    run_gloo_ranks(_emulated, 4, tmp_path, timeout_s=90)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(run["sum"] == [10.0] for run in runs)  # 1 + 2 + 3 + 4 on every holder
    last_launch = max(run["launched"] for run in runs)
    for run in runs:
        assert run["done"] >= last_launch + 0.14 - 0.005  # 0.1 s on the wire + 40 ms


def test_the_spec_names_a_region_for_every_rank():
    dp = pb.DataParallel(sync_groups=[pb.SyncGroupSpec(layer_start=0, layer_end=2, ranks=[0, 1, 2],
                                                       codec=codec_wire_id("none"), region_of=[0, 1],
                                                       emulate_latency_ms=10)])
    with pytest.raises(ValueError, match="2 regions for 3 ranks"):
        sync_group_plans(dp)
    with pytest.raises(ValueError, match="without a gap"):
        region_members((0, 1, 2), (0, 2, 2))
    dp.sync_groups[0].region_of[:] = [0, 1, 1]
    (plan,) = sync_group_plans(dp)
    # Emulated latency: once per hop of the leaders' ring (2 regions: 2 hops), not of all 3 holders (4).
    assert plan.regions == (0, 1, 1) and plan.emulation.latency_s == pytest.approx(0.02)
