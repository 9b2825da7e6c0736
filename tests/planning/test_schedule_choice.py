"""`schedule: auto`: the planner cuts for 1F1B, prices the same cut under ZB-H1 and ZB-H2 by
simulation and keeps the fastest whose memory fits every stage, moving to one that holds more
micro-batches only for AUTO_MORE_MEMORY_GAIN more tokens/s (launcher/planning/request.py)."""

from __future__ import annotations

import pytest
from plan_reference import regions_profile

from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.planner import check_priced, price_pipelines
from hetlaunch.launcher.planning.planning_error import PlanningError
from hetlaunch.launcher.planning.request import PlanRequest, plan_for
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.runtime.registry import AUTO_MORE_MEMORY_GAIN

NONE = CompressionConfig(intra_region="none", cross_region="none", sync="none")


def _request(schedule: str) -> PlanRequest:
    return PlanRequest(num_microbatches=8, schedule=schedule, compression=NONE, max_pipelines=1, stages=4)


def _profile():
    """Four equal nodes in one region, links all but free: a compute-bound 4-stage pipeline, where
    the zero-bubble schedules' smaller bubble shows."""
    return regions_profile(per_region=4, regions=("a",), num_layers=8, layer_s=0.01, output_bytes=2**20)


def _distant_profile():
    """Four equal nodes, each in a region of its own, 5 ms apart (under a stage's 6.7 ms forward):
    latency ZB-H2's window of 2S - 1 micro-batches hides and ZB-H1's of S waits for."""
    return regions_profile(per_region=1, regions=("a", "b", "c", "d"), num_layers=8, layer_s=0.01,
                           output_bytes=2**20, cross_bandwidth=1e10, cross_latency=0.005)


def _with_memory(profile, capacity: float):
    return profile.model_copy(update={"nodes": [n.model_copy(update={"memory_bytes": capacity})
                                                for n in profile.nodes]})


def _priced_on_the_same_cut(profile, auto) -> dict[str, float]:
    """tokens/s of the cut auto returns, under each schedule alone."""
    chains = [([s.node for s in p.cost.stages], [(s.layer_start, s.layer_end) for s in p.cost.stages],
               p.cost.num_microbatches) for p in auto.pipelines]
    return {name: price_pipelines(profile, chains, name, NONE).tokens_per_s for name in ("zb-h1", "zb-h2")}


def _floor(cost) -> float:
    """No schedule's step is shorter: the last stage waits for the first forward's way down, then
    runs M forwards and backwards and its optimizer."""
    *upstream, last = cost.stages
    return sum(s.forward_s + s.link_s + s.latency_s for s in upstream) + \
        cost.num_microbatches * (last.forward_s + last.backward_s) + last.optimizer_s


def test_auto_keeps_the_fastest_zero_bubble_schedule_and_says_what_each_was_priced_at():
    """Compute-bound: both zero-bubble schedules beat 1F1B by far. ZB-H2's step is the floor itself;
    ZB-H1's stays above it by what the gradients' climb over the links (0.1 ms each) costs it: under
    AUTO_MORE_MEMORY_GAIN, not worth ZB-H2's seven micro-batches in flight against ZB-H1's four, so
    ZB-H1 is kept."""
    profile = _profile()
    one = plan_for(profile, _request("1f1b"))
    auto = plan_for(profile, _request("auto"))
    assert auto.schedule == "zb-h1", auto.schedule_choice
    priced = _priced_on_the_same_cut(profile, auto)
    assert one.tokens_per_s * AUTO_MORE_MEMORY_GAIN < priced["zb-h1"] == auto.tokens_per_s
    assert priced["zb-h1"] < priced["zb-h2"] < priced["zb-h1"] * AUTO_MORE_MEMORY_GAIN
    chains = [([s.node for s in p.cost.stages], [(s.layer_start, s.layer_end) for s in p.cost.stages],
               p.cost.num_microbatches) for p in auto.pipelines]
    zb_h2 = price_pipelines(profile, chains, "zb-h2", NONE).pipelines[0].cost
    assert zb_h2.step_s == pytest.approx(_floor(zb_h2), rel=1e-9)
    assert f"1f1b {one.tokens_per_s:,.0f}, zb-h1 {priced['zb-h1']:,.0f}, zb-h2 {priced['zb-h2']:,.0f}; " \
           f"a schedule holding more micro-batches is kept for 2% more or better" in auto.schedule_choice
    assert all(p.cost.exact for p in auto.pipelines)  # priced by simulation, not the closed form
    for pipeline in auto.pipelines:  # the step reported is the simulation of exactly the plan returned
        check_priced(auto.schedule, pipeline.cost)
    assert auto.step_s == max(p.cost.step_s for p in auto.pipelines)


def test_auto_keeps_zb_h2_where_its_deeper_window_hides_the_latency():
    profile = _distant_profile()
    auto = plan_for(profile, _request("auto"))
    assert auto.schedule == "zb-h2", auto.schedule_choice
    priced = _priced_on_the_same_cut(profile, auto)
    one = plan_for(profile, _request("1f1b"))  # 1F1B deepens its windows where they pay: still slower
    assert auto.tokens_per_s == priced["zb-h2"] >= max(priced["zb-h1"], one.tokens_per_s) * AUTO_MORE_MEMORY_GAIN
    for pipeline in auto.pipelines:
        check_priced(auto.schedule, pipeline.cost)
        assert pipeline.cost.step_s == pytest.approx(_floor(pipeline.cost), rel=1e-9)  # a latency under an F: hidden
        # Memory as ZB-H2 holds it: 2S - 1 = 7 micro-batches at every stage, within each node's.
        cm = CostModel(profile, 8, "zb-h2")
        for j, s in enumerate(pipeline.cost.stages):
            assert s.memory_bytes == cm.memory_bytes(s.layer_start, s.layer_end, j, 4, window=7) <= s.capacity_bytes


def test_auto_falls_back_to_zb_h1_where_zb_h2s_extra_activations_do_not_fit():
    """The same distant nodes with room for ZB-H1's four micro-batches in flight and not ZB-H2's
    seven: ZB-H2 is not kept (nor named as priced), ZB-H1 is, and asked for alone ZB-H2 fits no cut."""
    profile = _distant_profile()
    cm = CostModel(profile, 8, "zb-h1")
    four, seven = (cm.memory_bytes(0, 2, 0, 4, window=w) for w in (4, 7))
    tight = _with_memory(profile, (four + seven) / 2)
    auto = plan_for(tight, _request("auto"))
    assert auto.schedule == "zb-h1", auto.schedule_choice
    assert "zb-h2" not in auto.schedule_choice
    assert all(s.memory_bytes <= s.capacity_bytes < seven for p in auto.pipelines for s in p.cost.stages)
    for pipeline in auto.pipelines:
        check_priced(auto.schedule, pipeline.cost)
    # Where it fits, ZB-H2 on this very cut is faster: memory alone ruled it out.
    roomy = _priced_on_the_same_cut(profile, auto)
    assert roomy["zb-h2"] > roomy["zb-h1"] == pytest.approx(auto.tokens_per_s)
    with pytest.raises(PlanningError):
        plan_for(tight, _request("zb-h2"))


def test_auto_keeps_1f1b_where_neither_zero_bubble_schedules_memory_fits():
    """ZB-H1 holds S micro-batches at every stage (ZB-H2 2S - 1), 1F1B S - j at stage j: nodes
    with room for three micro-batches' activations (and the first with room for four) fit 1F1B only."""
    profile = _profile()
    cm = CostModel(profile, 8, "1f1b")
    tight = cm.memory_bytes(2, 4, 1, 4) + 0.5 * (cm.memory_bytes(2, 4, 1, 4, window=4) - cm.memory_bytes(2, 4, 1, 4))
    nodes = [n.model_copy(update={"memory_bytes": tight}) if i else n for i, n in enumerate(profile.nodes)]
    auto = plan_for(profile.model_copy(update={"nodes": nodes}), _request("auto"))
    assert auto.schedule == "1f1b", auto.schedule_choice
    assert "zb-h1" not in auto.schedule_choice and "zb-h2" not in auto.schedule_choice  # not priced as fitting


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
    """Measured I and W as cheap as a full backward: a zero-bubble schedule wins as before (ZB-H1,
    as without measurements). Measured at twice the cost (small layers, where the split's extra
    autograd calls dominate): 1F1B is kept, both zero-bubble schedules priced below it."""
    profile = _profile()
    assert plan_for(_with_split(profile, 1.0), _request("auto")).schedule == "zb-h1"
    costly = plan_for(_with_split(profile, 2.0), _request("auto"))
    assert costly.schedule == "1f1b", costly.schedule_choice
    assert all(p.tokens_per_s < costly.tokens_per_s
               for p in (plan_for(_with_split(profile, 2.0), _request(name)) for name in ("zb-h1", "zb-h2")))
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


class _ColdStarts:
    """An emulation whose every piece of compute first pays a fixed start (a stand-in for what a
    piece pays in training after a wait: caches gone cold), and stretches nothing."""

    START_S = 0.02

    def __init__(self):
        self.pieces = 0

    def start(self) -> float:
        import time

        self.pieces += 1
        time.sleep(self.START_S)
        return time.perf_counter()

    def stretch(self, started, device) -> None:
        pass


def test_the_profiler_times_each_action_as_a_piece_of_its_own_as_the_executor_runs_it():
    """The executor runs a forward and a backward (or a forward, an I and a W) as separate actions,
    each starting after a wait; the profile pays each piece's start as they do. It once timed
    forward + backward as one piece, and I straight after an unstretched forward: small layers on
    CPU trained 1.2-1.3x slower than profiled, and a split backward looked free."""
    import torch

    from hetlaunch.runtime.model_spec import GPTConfig, ModelSpec
    from hetlaunch.runtime.node_measurement import profile_layers

    torch.set_num_threads(1)
    cold = _ColdStarts()
    layers = profile_layers(ModelSpec(gpt=GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2)), 1,
                            torch.device("cpu"), emulation=cold, repeats=1, warmup=0)
    start = _ColdStarts.START_S
    for m in layers:
        assert m.seconds >= 2 * start, m  # the forward's start and the backward's
        assert m.weight_grad_seconds >= start
    assert all(m.input_grad_seconds >= start for m in layers[1:])
    # per layer: forward and backward, then the split's forward (untimed, stretched), I and W, and
    # the optimizer step where it has weights (every layer of the GPT has)
    assert cold.pieces == len(layers) * (2 + 3 + 1)
