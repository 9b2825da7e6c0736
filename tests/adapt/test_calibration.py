"""Calibration: the plan checked against the first steps, per-node speed corrections, the plan
priced again on the corrected profile; and the straggler knob it is tested with (speed_changes)."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import yaml

from conftest import hetlaunch_env, run_hetlaunch
from hetlaunch.launcher.adapt.calibration import CALIBRATION_STEPS, Calibration
from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.planning.compression import NONE
from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.launcher.planning.planner import price_pipelines
from hetlaunch.launcher.planning.profile_file import load_profile
from hetlaunch.launcher.run_record import StepRecord
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.emulation import emulated_speed
from plan_reference import random_profile


def test_speed_changes_take_effect_at_their_step_and_are_checked():
    emulate = pb.Emulation(speed=0.5, speed_changes=[pb.SpeedChange(at_step=3, speed=0.25),
                                                     pb.SpeedChange(at_step=7, speed=1.0)])
    assert [emulated_speed(emulate, s).speed for s in (0, 2, 3, 6, 7, 100)] == [0.5, 0.5, 0.25, 0.25, 1.0, 1.0]
    assert emulated_speed(pb.Emulation(), 5).speed == 1.0

    def node(**emulate):
        return yaml.safe_dump({"nodes": [{"name": "a", "device": "cpu", "emulate": emulate}]})

    assert parse_cluster(node(speed_changes=[{"at_step": 0, "speed": 0.5}])).nodes[0].emulate.speed_changes[0].speed == 0.5
    for bad, words in (([{"at_step": 5, "speed": 0.5}, {"at_step": 2, "speed": 1}], "must increase"),
                       ([{"at_step": 1, "speed": 0}], "speed"), ([{"at_step": -1, "speed": 0.5}], "at_step")):
        with pytest.raises(ConfigError, match=words):
            parse_cluster(node(speed_changes=bad))


def test_calibration_fits_each_nodes_compute_and_prices_the_plan_again(tmp_path):
    profile = random_profile(random.Random(5), 2, 1, 4)
    priced = price_pipelines(profile, [(["n0", "n1"], [(0, 2), (2, 4)], 4)], "1f1b", NONE)
    cost = priced.pipelines[0].cost
    stages = tuple(StagePlan(node=s.node, region="r0", layer_start=s.layer_start, layer_end=s.layer_end,
                             compute_s=s.compute_s, link_s=s.link_s, latency_s=s.latency_s) for s in cost.stages)
    plan = Plan(stages=stages, num_layers=4, micro_batch_size=4, num_microbatches=4, schedule="1f1b", source="planned",
                predicted_step_s=priced.step_s, predicted_tokens_per_s=priced.tokens_per_s, compression=NONE)
    slower = {"n0": 1.5, "n1": 3.0}  # each node computes this much slower than profiled
    current = CurrentPlan()
    current.launch(plan)
    calibration = Calibration(tmp_path, current)
    calibration.new_generation(profile)
    for step in range(1 + CALIBRATION_STEPS + 4):
        stage_reports = [{"node": s.node, "pipeline": 0, "stage": j, "compute_s": 4 * s.compute_s * slower[s.node],
                          "step_s": 1.0, "comm_s": 0.0, "sync_s": 0.0} for j, s in enumerate(stages)]
        calibration.add(StepRecord(step=step, loss=1.0, tokens_per_s=1.0, step_s=0.5 if step else 9.0,
                                   stages=stage_reports))
    result = json.loads((tmp_path / "calibration.json").read_text())
    assert result["steps"] == [1, CALIBRATION_STEPS]  # the first step is warm-up
    assert result["node_speed_factors"] == pytest.approx(slower, rel=1e-4)
    scaled = load_profile(tmp_path / "profile-calibrated.json")
    for node in profile.nodes:
        assert scaled.node(node.name).layer_seconds == pytest.approx([t * slower[node.name] for t in node.layer_seconds])
    again = price_pipelines(scaled, [(["n0", "n1"], [(0, 2), (2, 4)], 4)], "1f1b", NONE)
    assert result["calibrated_step_s"] == pytest.approx(again.step_s) and again.step_s > priced.step_s
    assert result["unexplained_step_s"] == pytest.approx(0.5 - again.step_s)
    done = calibration.finish([StepRecord(step=s, loss=1.0, tokens_per_s=1.0, step_s=0.6, stages=[])
                               for s in range(CALIBRATION_STEPS + 1, CALIBRATION_STEPS + 5)])
    assert done["after_window"]["steps"] == 4
    assert done["after_window"]["error_calibrated"] == pytest.approx((0.5 - 0.6) / 0.6)
    assert "plan_changed_at_step" not in done["after_window"]

    # After a recovery (or a live move) the steps ran another plan: they were compared with this
    # plan's predictions as if they were its own.
    later = [StepRecord(step=s, loss=1.0, tokens_per_s=1.0, step_s=0.6 if s < CALIBRATION_STEPS + 3 else 5.0, stages=[])
             for s in range(CALIBRATION_STEPS + 1, CALIBRATION_STEPS + 9)]
    calibration.new_generation(profile, first_step=CALIBRATION_STEPS + 3)
    calibration.plan_changed(CALIBRATION_STEPS + 6)  # a later change keeps the first
    done = calibration.finish(later)
    assert done["after_window"]["steps"] == 2 and done["after_window"]["measured_step_s"] == 0.6
    assert done["after_window"]["plan_changed_at_step"] == CALIBRATION_STEPS + 3
    assert json.loads((tmp_path / "calibration.json").read_text())["after_window"]["steps"] == 2


@pytest.mark.solo
@pytest.mark.timeout(300)
def test_a_node_profiled_faster_than_it_trains_is_found_and_the_prediction_corrected(tmp_path):
    """Node b is profiled as a is (the same profile: both read one cache entry) and trains at a
    quarter of that speed (speed_changes from step 0): the plan, made from the profile, is too
    optimistic; calibration finds b slower than a and its corrected prediction moves toward
    what the same steps measured.

    What load cannot move is asserted, on like windows: the factors are recomputed from the
    run's own metrics of the calibration steps (not compared with later steps, which a shared
    machine runs 15-30% faster or slower), and b's factor is compared with a's, not with 1. Two
    nodes profiled one after another on a busy 2-core machine differed by 1.45x with nothing
    between them, which once made b look no slower than a (factors 0.98 and 1.05 with b at half
    speed); one cache entry for both removes that. b is four times slower, not two, so that the
    factor keeps a margin where emulation is inexact (more busy threads than cores): with a busy
    loop beside it b's factor came out 4.3x a's, asserted above 2x."""
    cluster = {"name": "cal", "model": {"preset": "tiny", "n_layers": 2, "seq_len": 32, "d_model": 32},
               "train": {"steps": 40, "micro_batch_size": 4, "num_microbatches": 4, "checkpoint_every": 0},
               "nodes": [{"name": "a", "device": "cpu", "threads": 1, "layers": [0, 2], "emulate": {"speed": 0.25}},
                         {"name": "b", "device": "cpu", "threads": 1, "layers": [2, 4],
                          "emulate": {"speed": 0.25, "speed_changes": [{"at_step": 0, "speed": 0.0625}]}}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    # a and b are the same kind of node (device, threads, speed, model): one cache key. Profiled
    # here first, into a cache of the test's own, `up` then gives both the one entry.
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
    profiled = run_hetlaunch("profile", str(tmp_path / "c.yaml"), "-o", str(tmp_path / "p.json"), "--run-dir",
                             str(tmp_path / "profiling"), timeout=120, env=env, cwd=tmp_path)
    assert profiled.returncode == 0, profiled.stderr + profiled.stdout
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir), timeout=220, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    profile = load_profile(run_dir / "profile.json")
    assert profile.node("a").layer_seconds == profile.node("b").layer_seconds  # profiled alike, exactly
    calibration = json.loads((run_dir / "summary.json").read_text())["calibration"]
    assert calibration == json.loads((run_dir / "calibration.json").read_text())
    assert calibration["steps"] == [1, CALIBRATION_STEPS]

    # The factors are the calibration window's own: median measured compute per micro-batch ÷ the plan's.
    plan = next(json.loads(line)["plan"] for line in (run_dir / "events.jsonl").read_text().splitlines()
                if json.loads(line)["event"] == "generation")
    window = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:1 + CALIBRATION_STEPS]
    factors = calibration["node_speed_factors"]
    for stage in plan["stages"]:
        measured = statistics.median(s["compute_s"] for r in window for s in r["stages"] if s["node"] == stage["node"])
        assert factors[stage["node"]] == pytest.approx(measured / 4 / stage["compute_s"], rel=1e-3, abs=1e-4)
    assert factors["b"] > 2 * factors["a"], factors  # b trains at a quarter of the speed it was profiled at

    # On those same steps: the profile's plan was too optimistic (b, its slowest stage, is four
    # times slower than profiled) and the corrected profile's price of the same plan moves toward
    # what they measured. How much of the step stays unexplained (the Python, data and control
    # plane around the kernels) grows with load: 10% beside one busy loop, 29% at load 8.5,
    # where before was -51%; so the corrected error is not held to a fraction of it.
    measured_step = calibration["measured_step_s"]
    assert measured_step == pytest.approx(statistics.median(r["step_s"] for r in window))
    assert calibration["unexplained_step_s"] == pytest.approx(measured_step - calibration["calibrated_step_s"])
    before = (calibration["predicted_step_s"] - measured_step) / measured_step
    assert before < -0.25 and calibration["calibrated_step_s"] > 1.2 * calibration["predicted_step_s"], calibration
    assert calibration["after_window"]["steps"] == 40 - 1 - CALIBRATION_STEPS  # and the later steps are reported
    assert "calibration (steps 1–8)" in result.stdout
    load_profile(run_dir / "profile-calibrated.json")  # `hetlaunch plan --profile` can read it
