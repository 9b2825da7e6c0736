"""The islands' outer step on three real gloo ranks (runtime/outer_sync.py, built as a stage builds
it: runtime/stage_command.py _outer_sync): ranks 0 and 1 are one island (two pipelines), rank 2
another. The representative (rank 0) passes the averaged change on to rank 1; under
data_plane.encrypt `all` that pass is sealed (a hostile review found it a clear broadcast,
unauthenticated, applied as it came). Sealed or clear, all three end on the same parameters,
bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import run_gloo_ranks
from data_plane_keys import rendezvous_keys
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.stage_command import _outer_sync



def _rank(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    layout = [pb.StagePlace(rank=r, pipeline=r, layer_start=0, layer_end=1, region="west" if r == 2 else "east",
                            node=f"n{r}") for r in range(3)]
    dp = pb.DataParallel(islands=[pb.IslandRanks(ranks=[0, 1]), pb.IslandRanks(ranks=[2])],
                         pipeline_microbatches=[1, 1, 2],
                         outer=pb.OuterSpec(every=1, lr=0.7, momentum=0.9,
                                            groups=[pb.SyncGroupSpec(layer_start=0, layer_end=1, ranks=[0, 1, 2],
                                                                     codec=pb.CODEC_NONE)]))
    result = {}
    for mode in ("off", "all"):
        torch.manual_seed(0)
        layer = nn.Linear(8, 8)  # the same start on every rank
        rdzv = pb.Rendezvous(rank=rank, generation=1, data_plane_encrypt=mode,
                             **rendezvous_keys(rank, 3))
        outer = _outer_sync(dp, layout, SimpleNamespace(layers=[layer], num_layers=1, tied=()), 0,
                            torch.device("cpu"), None, rdzv)
        outer.reset_anchor()
        with torch.no_grad():  # each island's inner steps moved it apart (rank 1 as its island's rank 0)
            for p in layer.parameters():
                p.add_(torch.full_like(p, 0.01 * (1 if rank < 2 else -3)))
        outer.after_step(1)
        result[mode] = {"params": [p.detach().flatten().tolist() for p in layer.parameters()],
                        "share_bytes": sum(h.shared_sealed.wire_bytes for h in outer.held if h.shared_sealed),
                        "share_sealed": any(h.shared_sealed is not None for h in outer.held)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(90)
def test_the_average_passed_on_inside_an_island_is_sealed_and_lands_bit_for_bit(tmp_path):
    run_gloo_ranks(_rank, 3, tmp_path, timeout_s=60)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for mode in ("off", "all"):
        assert ranks[0][mode]["params"] == ranks[1][mode]["params"] == ranks[2][mode]["params"], mode
    assert ranks[0]["off"]["params"] == ranks[0]["all"]["params"]  # sealing is lossless
    # Under `all` the island's holders pass the average sealed: the representative sent it, once per holder.
    assert [r["all"]["share_sealed"] for r in ranks] == [True, True, False]
    assert ranks[0]["all"]["share_bytes"] > 0 and ranks[1]["all"]["share_bytes"] == 0
    assert not any(r["off"]["share_sealed"] for r in ranks)
