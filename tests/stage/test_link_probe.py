"""The link probe (runtime/node_measurement.py probe_link) on real gloo ranks over an emulated link."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import run_gloo_ranks
from hetlaunch.runtime.codecs import NoneCodec
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.link import Link

NONE = NoneCodec()
CPU = torch.device("cpu")


def _slow_probe_rank(rank: int, out_dir: str) -> None:
    """On a 0.5 Mbit/s link the probe stops after its first size (64 KiB takes about 1 s; the next,
    four times as long, is over the budget): the three sizes three times each took 70 s at 2 Mbit/s
    and passed the 120 s receive timeout below 1 Mbit/s. The estimate from the one size is close."""
    from hetlaunch.runtime.node_measurement import probe_link

    bytes_per_s = 0.5e6 / 8
    link = Link(1 - rank, NONE, CPU, CPU, tag=2, emulation=WireEmulation(bandwidth_bytes_per_s=bytes_per_s))
    measured = probe_link(link, initiator=rank == 0, pings=2, sizes=(64 * 1024, 256 * 1024, 1024 * 1024))
    if rank == 0:
        latency, bandwidth = measured
        assert link.stats.messages == 2 + 3 + 1, link.stats  # pings, one size three times, the word to stop
        assert bandwidth == pytest.approx(bytes_per_s, rel=0.15), bandwidth
    dist.barrier()


@pytest.mark.timeout(90)
def test_the_link_probe_stops_growing_where_a_size_would_take_too_long(tmp_path):
    run_gloo_ranks(_slow_probe_rank, 2, tmp_path)
