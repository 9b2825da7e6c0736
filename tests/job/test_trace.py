"""runs/<id>/trace.json: sampled steps' timelines of every stage on one clock, beside the plan's prediction."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, run_hetlaunch
from hetlaunch.runtime.clock_offset import ClockOffset
from hetlaunch.runtime.schedules import one_f_one_b, simulate, simulated_timeline

CLOCK_TOLERANCE_S = 0.005  # "within a few ms on one machine"


def test_clock_offset_keeps_the_tightest_round_trip():
    clock = ClockOffset()
    assert not clock.known
    clock.sample(100.0, 150.2, 100.4)  # coordinator 50 s ahead, 0.4 s round trip
    assert clock.known and clock.offset_s == pytest.approx(50.0) and clock.rtt_s == pytest.approx(0.4)
    clock.sample(200.0, 250.9, 201.0)  # a slower trip: kept out
    assert clock.offset_s == pytest.approx(50.0)
    clock.sample(300.0, 350.05, 300.1)  # tighter: taken
    assert clock.offset_s == pytest.approx(50.0) and clock.rtt_s == pytest.approx(0.1)
    clock.sample(400.0, 0.0, 400.01)  # a coordinator that does not say its time: ignored
    clock.sample(500.0, 550.0, 499.0)  # the clock stepped back mid-trip: ignored
    assert clock.offset_s == pytest.approx(50.0) and clock.rtt_s == pytest.approx(0.1)


def test_simulated_timeline_is_the_simulation_action_by_action():
    per_stage = [one_f_one_b(s, 3, 5) for s in range(3)]
    forward, backward, wire, latency = [1.0, 2.0, 1.5], [2.0, 4.0, 3.0], [0.5, 0.25], [0.1, 0.2]
    timeline = simulated_timeline(per_stage, forward, backward, wire, latency)
    assert [[a for a, _, _ in stage] for stage in timeline] == per_stage
    for s, stage in enumerate(timeline):
        for (a, start, end), (_, next_start, _) in zip(stage, stage[1:]):
            assert next_start >= end - 1e-12, "a stage runs one action at a time, in its order"
        for a, start, end in stage:
            assert end - start == pytest.approx((forward if a.kind.name == "FORWARD" else backward)[s])
    assert max(end for stage in timeline for _, _, end in stage) == pytest.approx(
        simulate(per_stage, forward, backward, wire, latency))


def test_the_predicted_trace_draws_the_forward_backward_and_split_the_plan_was_priced_with():
    """A zero-bubble plan's predicted track once drew I and W as a third of each stage's time
    whatever the planner had priced them at; now each span is the plan's own part, and the track
    ends where the simulation of those parts does."""
    from hetlaunch.launcher.planning.plan import Plan, StagePlan
    from hetlaunch.launcher.timeline import PREDICTED_PID, _predicted
    from hetlaunch.runtime.schedules import SCHEDULES

    parts = [(0.010, 0.022, 0.0, 0.022), (0.030, 0.055, 0.040, 0.025), (0.020, 0.041, 0.027, 0.019)]
    stages = tuple(StagePlan(f"n{j}", "r", j, j + 1, compute_s=f + b, link_s=0.001, latency_s=0.02, pipeline=0,
                             forward_s=f, backward_s=b, input_grad_s=i, weight_grad_s=w)
                   for j, (f, b, i, w) in enumerate(parts))
    plan = Plan(stages=stages, num_layers=3, micro_batch_size=1, num_microbatches=6, schedule="zb-h1",
                source="planned", pipeline_microbatches=(6,))
    spans = _predicted(plan, stages, 6, 0, 4, 1.0)
    assert {e["pid"] for e in spans} == {PREDICTED_PID}
    for e in spans:
        f, b, i, w = parts[e["tid"]]
        want = {"F": f, "I": i, "W": w}[e["name"][0]]
        assert e["dur"] == pytest.approx(want * 1e6, abs=1e-3), e
    per_stage = [SCHEDULES["zb-h1"].actions(3, 6)[j] for j in range(3)]
    end = simulate(per_stage, [p[0] for p in parts], [p[1] for p in parts], [0.001] * 2, [0.02] * 2,
                   input_grad_cost=[p[2] for p in parts], weight_grad_cost=[p[3] for p in parts])
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx((1.0 + end) * 1e6, abs=1e-2)


@pytest.mark.timeout(240)
def test_up_writes_a_chrome_trace_of_every_scheduled_action_on_one_clock(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    # 1F1B pinned: its F and B spans are what this test reads (auto may choose ZB-H1's F, I and W)
    cluster["train"].update(steps=6, checkpoint_every=0, num_microbatches=4, schedule="1f1b")
    cluster["observe"] = {"trace_every": 2}
    for node, layers in zip(cluster["nodes"], ([0, 1], [1, 3], [3, 4])):  # three stages on three agents
        node["layers"] = layers
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir), timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout

    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float | int) for e in spans)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 1)] == "stage 1: n1 (default)" and names[(1000, 2)] == "stage 2: n2 (default)"
    assert trace["otherData"]["sampled_steps"] == [0, 2, 4]

    expected = sorted([f"F{m}" for m in range(4)] + [f"B{m}" for m in range(4)])
    for step in (0, 2, 4):
        for pid in (0, 1000):  # measured, and the planner's prediction of the same step
            for stage in range(3):
                got = sorted(e["name"] for e in spans if (e["pid"], e["tid"], e["args"]["step"]) == (pid, stage, step)
                             and e["name"][0] in "FB")
                assert got == expected, (step, pid, stage, got)
        # On one clock: a stage cannot finish a forward before the previous stage has begun it,
        # nor a backward before the next stage has. (Not "finished": a span ends when its isend
        # returns, and a sender descheduled right after its peer received ends its span later
        # than the peer's by however long the machine keeps it waiting, 20 ms or more under load.)
        at = {(e["tid"], e["name"]): e for e in spans if e["pid"] == 0 and e["args"]["step"] == step}
        for m in range(4):
            for j in range(2):
                down, up = at[(j, f"F{m}")], at[(j + 1, f"F{m}")]
                assert up["ts"] + up["dur"] >= down["ts"] - CLOCK_TOLERANCE_S * 1e6, (step, m, j, down, up)
                back, front = at[(j + 1, f"B{m}")], at[(j, f"B{m}")]
                assert front["ts"] + front["dur"] >= back["ts"] - CLOCK_TOLERANCE_S * 1e6, (step, m, j, back, front)
        assert {e["name"] for e in at.values()} >= {"optimizer", "drain sends", "recv"}
    clocks = trace["otherData"]["clocks"]  # each agent's offset, measured from its heartbeats
    assert set(clocks) == {"n0", "n1", "n2"}
    assert all(c["round_trip_ms"] is not None and 0 < c["round_trip_ms"] < 100 for c in clocks.values()), clocks
    assert all(abs(c["offset_ms"]) < CLOCK_TOLERANCE_S * 1e3 for c in clocks.values()), clocks


@pytest.mark.timeout(120)
def test_trace_every_zero_writes_no_trace(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    cluster["train"].update(steps=2, checkpoint_every=0)
    cluster["observe"] = {"trace_every": 0}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(tmp_path / "run"), timeout=100,
                           cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert not (tmp_path / "run" / "trace.json").exists()


def test_a_report_behind_the_newest_sampled_steps_is_dropped_not_a_crash(tmp_path):
    """After `up` was stopped for 13 s, one node's backlog of sampled steps came in after another's
    newer ones: its oldest was pruned as it was added, and the KeyError ended `up` (a hostile review)."""
    from hetlaunch.launcher.planning.plan import Plan, StagePlan
    from hetlaunch.launcher.timeline import MAX_STEPS, Timeline
    from hetlaunch.protos import control_pb2 as pb

    plan = Plan(stages=(StagePlan("n0", "a", 0, 2), StagePlan("n1", "a", 2, 4)), num_layers=4, micro_batch_size=2,
                num_microbatches=1, schedule="1f1b", source="even")
    timeline = Timeline(tmp_path)

    def report(step: int) -> pb.StepMetrics:
        return pb.StepMetrics(step=step, trace=[pb.TraceEvent(name="forward", start=step, end=step + 0.1, microbatch=0)])
    for step in range(MAX_STEPS + 2):
        timeline.add("n0", report(step), plan, {})
    timeline.add("n1", report(0), plan, {})  # behind the newest MAX_STEPS: dropped
    assert not timeline.path.exists()
    timeline.add("n1", report(MAX_STEPS + 1), plan, {})  # a step both stages sent: written
    names = {e.get("name") for e in json.loads(timeline.path.read_text())["traceEvents"]}
    assert "F0" in names  # the forward of micro-batch 0
