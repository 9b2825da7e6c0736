"""`schedule: auto`: the planner cuts for 1F1B, prices the same cut under ZB-H1 by simulation and
keeps the faster whose memory fits every stage (launcher/planning/request.py)."""

from __future__ import annotations

from plan_reference import regions_profile

from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import check_priced
from hetlaunch.launcher.planning.request import PlanRequest, plan_for
from hetlaunch.launcher.planning.compression import CompressionConfig

NONE = CompressionConfig(intra_region="none", cross_region="none", sync="none")


def _request(schedule: str) -> PlanRequest:
    return PlanRequest(num_microbatches=8, schedule=schedule, compression=NONE, max_pipelines=1, stages=4)


def _profile():
    """Four equal nodes in one region, links free: a compute-bound 4-stage pipeline, where ZB-H1's
    smaller bubble shows."""
    return regions_profile(per_region=4, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**20)


def test_auto_keeps_zb_h1_where_its_smaller_bubble_wins_and_says_what_each_was_priced_at():
    profile = _profile()
    one = plan_for(profile, _request("1f1b"))
    zb = plan_for(profile, _request("zb-h1"))
    auto = plan_for(profile, _request("auto"))
    assert auto.schedule == "zb-h1" and auto.tokens_per_s > one.tokens_per_s
    # The cut searched under 1F1B, priced under ZB-H1: here the same cut the ZB-H1 search finds.
    assert auto.tokens_per_s >= zb.tokens_per_s * (1 - 1e-9)
    assert f"1f1b {one.tokens_per_s:,.0f}" in auto.schedule_choice and "zb-h1" in auto.schedule_choice
    assert all(p.cost.exact for p in auto.pipelines)  # priced by simulation, not the closed form
    for pipeline in auto.pipelines:  # the step reported is the simulation of exactly the plan returned
        check_priced(auto.schedule, pipeline.cost)
    assert auto.step_s == max(p.cost.step_s for p in auto.pipelines)


def test_auto_keeps_1f1b_where_zb_h1s_memory_does_not_fit():
    """ZB-H1 holds S micro-batches at every stage, 1F1B S - j at stage j: nodes with room for
    three micro-batches' activations (and the first with room for four) fit 1F1B only."""
    profile = _profile()
    cm = CostModel(profile, 8, "1f1b")
    tight = cm.memory_bytes(2, 4, 1, 4) + 0.5 * (cm.memory_bytes(2, 4, 1, 4, window=4) - cm.memory_bytes(2, 4, 1, 4))
    nodes = [n.model_copy(update={"memory_bytes": tight}) if i else n for i, n in enumerate(profile.nodes)]
    auto = plan_for(profile.model_copy(update={"nodes": nodes}), _request("auto"))
    assert auto.schedule == "1f1b", auto.schedule_choice
    assert "zb-h1" not in auto.schedule_choice  # not priced as a candidate that fits


def test_one_stage_has_no_bubble_to_win_and_keeps_1f1b():
    profile = regions_profile(per_region=1, regions=("a",), num_layers=4, layer_s=0.01)
    auto = plan_for(profile, PlanRequest(num_microbatches=4, schedule="auto", compression=NONE, max_pipelines=1))
    assert auto.schedule == "1f1b"


def _with_split(profile, overhead: float):
    """Every node measured I and W: half the backward each, times `overhead` (what splitting costs)."""
    nodes = [n.model_copy(update={"input_grad_seconds": [t / 3 * overhead for t in n.layer_seconds],
                                  "weight_grad_seconds": [t / 3 * overhead for t in n.layer_seconds]})
             for n in profile.nodes]
    return profile.model_copy(update={"nodes": nodes})


def test_auto_prices_the_split_backward_each_node_measured():
    """Measured I and W as cheap as a full backward: ZB-H1 wins as before. Measured at twice the
    cost (small layers, where the split's extra autograd calls dominate): 1F1B is kept."""
    profile = _profile()
    assert plan_for(_with_split(profile, 1.0), _request("auto")).schedule == "zb-h1"
    costly = plan_for(_with_split(profile, 2.0), _request("auto"))
    assert costly.schedule == "1f1b", costly.schedule_choice
    zb = plan_for(_with_split(profile, 2.0), _request("zb-h1"))
    assert all(s.input_grad_s > 0 for s in zb.pipelines[0].cost.stages[1:])
    assert zb.pipelines[0].cost.stages[0].input_grad_s == 0  # the first stage sends no gradient


def test_the_profiler_measures_the_split_backward():
    import torch

    from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
    from hetlaunch.runtime.node_measurement import profile_layers

    torch.set_num_threads(1)
    layers = profile_layers(ModelSpec(gpt=GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)), 2,
                            torch.device("cpu"), repeats=2, warmup=1)
    assert layers[0].input_grad_seconds == 0 and layers[0].weight_grad_seconds > 0  # token ids: no input gradient
    assert all(m.input_grad_seconds > 0 and m.weight_grad_seconds > 0 for m in layers[1:])
