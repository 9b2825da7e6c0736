"""Two pipelines of a several-stages-per-device schedule, run: real processes in one gloo group,
each device's executor holding the stages its placement gives it, and gradient sync between the
pipelines (runtime/grad_sync.py) over layers a device holds in non-adjacent ranges.

Pipeline 0 runs on ranks 0-1, pipeline 1 on ranks 2-3, each cut differently into v·D = 4 stages,
so a sync group's two holders hold its layers in different stages of their pipelines (and
under ZB-V, a device's first and last stage are the model's two ends); and pipelines of one device
each, as 1F1B's planner may give them, whose two stages hand off in memory. The step's micro-batches
are split between the pipelines, each loss divided by the global count; per-step losses and final
parameters equal single-process training (rel <= 1e-5: the same fp32 arithmetic, summed in
another order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_gloo_ranks
from device_pipeline_model import CPU, LAYERS, STEPS, M, _batches, _close, _layers, _loss, _reference
from hetlaunch.launcher.planning.sync_groups import sync_groups
from hetlaunch.runtime.codecs import codec_by_name
from hetlaunch.runtime.device_schedules import device_schedule_named
from hetlaunch.runtime.executor import StageExecutor, StagePart
from hetlaunch.runtime.grad_sync import GradientSync, SyncGroupPlan, make_groups
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.local_link import local_boundary

# Each pipeline's stages as layer ranges, by devices per pipeline: pipeline 1 is cut elsewhere, so
# the holder sets change inside pipeline 0's stages. On one device both stages hand off in memory.
CUTS = {2: ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (1, 4), (4, 7), (7, 8)]),
        1: ([(0, 4), (4, 8)], [(0, 3), (3, 8)])}


def _pipeline_device(rank: int, out_dir: str, schedule: str, shares: tuple[int, int], devices: int) -> None:
    torch.set_num_threads(1)
    pipeline, device = divmod(rank, devices)
    placed = device_schedule_named(schedule)
    where = [placed.stage_device(s, devices) for s in range(placed.num_stages(devices))]
    cut = CUTS[devices][pipeline]
    mine = [s for s, d in enumerate(where) if d == device]
    layers = _layers()
    local: dict[int, tuple] = {}

    def link(boundary: int, toward: int):
        if where[boundary] == where[boundary + 1]:
            ends = local.setdefault(boundary, local_boundary(boundary))
            return ends[0] if toward == boundary + 1 else ends[1]
        return Link(pipeline * devices + where[toward], codec_by_name("none"), CPU, CPU, tag=boundary)

    parts = [StagePart(s, cut[s][1] - cut[s][0], None if s == 0 else link(s - 1, s - 1),
                       None if s == len(cut) - 1 else link(s, s + 1)) for s in mine]
    held_index = [i for s in mine for i in range(*cut[s])]
    held = [layers[i] for i in held_index]
    # Every rank makes every group, in order; a group's ranks are its holders' devices.
    plans = [SyncGroupPlan(g.layer_start, g.layer_end,
                           tuple(p * devices + where[s] for p, s in g.holders), codec_by_name("none"))
             for g in sync_groups([list(c) for c in CUTS[devices]])]
    local_of = {g: i for i, g in enumerate(held_index)}
    sync = GradientSync(held, 0, plans, make_groups(plans), CPU, local_index=local_of.__getitem__)
    executor = StageExecutor(held, _loss, is_first=False, is_last=False, device=CPU, parts=parts, grad_sync=sync)
    actions = placed.actions(devices, shares[pipeline])[device]
    first = sum(shares[:pipeline])
    losses = [executor.train_step(actions, _batches(step)[first:first + shares[pipeline]], M).loss
              for step in range(STEPS)]
    params = {f"{i}.{name}": p.detach().flatten().tolist()
              for i in held_index for name, p in layers[i].named_parameters()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"losses": losses if executor.is_last else None,
                                                             "params": params, "pipeline": pipeline}))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule, shares, devices", [("zb-v", (3, 1), 2), ("interleaved-1f1b", (2, 2), 2),
                                                       ("zb-v", (2, 2), 1)])
def test_two_pipelines_of_several_stages_per_device_equal_single_process_training(tmp_path, schedule, shares,
                                                                                  devices):
    assert sum(shares) == M and LAYERS == CUTS[devices][0][-1][1]
    losses, params = _reference()
    run_gloo_ranks(_pipeline_device, 2 * devices, tmp_path, timeout_s=180, args=(schedule, shares, devices))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2 * devices)]
    # each pipeline's loss is its share of the global mean (divided by M): weighted, they sum to it
    by_pipeline = {r["pipeline"]: r["losses"] for r in results if r["losses"] is not None}
    assert sorted(by_pipeline) == [0, 1]
    got = [sum(by_pipeline[p][step] * shares[p] for p in (0, 1)) / M for step in range(STEPS)]
    assert _close(got, losses), (got, losses)
    for r in results:  # both replicas hold the single-process weights
        for name, value in r["params"].items():
            assert _close(value, params[name]), (r["pipeline"], name)
    assert {name for r in results if r["pipeline"] == 1 for name in r["params"]} == params.keys()
    assert got[-1] < got[0]
