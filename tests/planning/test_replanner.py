"""The replanner: the one object a running job asks for a plan, a re-cut, a re-plan, a price or a
join, from the profile it owns (as measured, and as corrected by what training measured)."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import run_hetlaunch
from rebalance_fixtures import cluster, profile, replanner
from hetlaunch.launcher.adapt.replanner import JOIN_GAIN, Replanner
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.plan import Plan, StagePlan, planned
from hetlaunch.launcher.planning.planner import price_pipelines
from hetlaunch.launcher.planning.profile_file import save_profile
from hetlaunch.launcher.planning.request import PlanRequest, plan_for

EVEN = {"a": 0.01, "b": 0.01, "c": 0.01}


def _cuts(plan) -> list[tuple]:
    return [(s.node, s.layer_start, s.layer_end) for s in plan.stages]


def test_the_first_plan_is_the_planners_for_the_train_section_and_carries_its_codecs():
    planner = replanner(EVEN)
    plan, result = planner.first()
    expected = plan_for(planner.measured, PlanRequest.for_train(planner.cluster.train, planner.cluster.compression))
    assert plan.predicted_step_s == expected.step_s == result.step_s and plan.source == "planned"
    assert plan.compression == planner.cluster.compression and result.compression == planner.cluster.compression


def test_a_plan_for_some_nodes_uses_only_them_and_says_why_none_fits():
    planner = replanner(EVEN)
    assert {s.node for s in planner.plan(["a", "c"]).stages} <= {"a", "c"}
    small = planner.measured.model_copy(update={"nodes": [n.model_copy(update={"memory_bytes": 1.0})
                                                          for n in planner.measured.nodes]})
    with pytest.raises(JobError, match=r"the nodes left \(a\) cannot train the model"):
        Replanner(planner.cluster, small, lambda: ["a"]).replan()
    with pytest.raises(JobError, match="no node is left"):
        Replanner(planner.cluster, planner.measured, lambda: []).replan()


def test_price_recut_and_rebalance_use_the_corrected_profile_and_replans_the_measured_one():
    planner = replanner(EVEN)
    plan, _ = planner.first()
    planner.calibrated(planner.measured)
    assert planner.price(plan) == pytest.approx(plan.predicted_step_s)  # its own figure, on the same profile
    planner.node_slower("b", 3.0)
    assert planner.corrected.node("b").layer_seconds[0] == pytest.approx(0.03)
    assert planner.measured.node("b").layer_seconds[0] == 0.01  # as measured: re-plans after a loss use it
    chains = [([s.node for s in plan.stages], [(s.layer_start, s.layer_end) for s in plan.stages], plan.num_microbatches)]
    assert planner.price(plan) == price_pipelines(planner.corrected, chains, plan.schedule, plan.compression).step_s
    moved = planner.recut(plan)
    assert [(s.node, s.pipeline, s.window) for s in moved.stages] == [(s.node, s.pipeline, s.window) for s in plan.stages]
    assert dict((n, e - s) for n, s, e in _cuts(moved))["b"] < dict((n, e - s) for n, s, e in _cuts(plan))["b"]
    assert moved.predicted_step_s < planner.price(plan) and planner.move_seconds(plan, moved) > 0
    assert planner.rebalanced().predicted_step_s <= moved.predicted_step_s + 1e-12
    assert planner.plan(["a", "b", "c"]).predicted_step_s == pytest.approx(plan.predicted_step_s)


def test_a_slow_link_goes_into_the_corrected_profile():
    planner = replanner(EVEN)
    planner.calibrated(planner.measured)
    link = planner.measured.links[0]
    bandwidth = planner.link_carries("a", "b", link, seconds=link.latency_s + 0.01, wire_bytes=1e4)
    assert bandwidth == pytest.approx(1e6)
    corrected = planner.corrected
    assert corrected.link(corrected.node("a"), corrected.node("b")).bandwidth_bytes_per_s == pytest.approx(1e6)
    assert corrected.link(corrected.node("a"), corrected.node("c")).bandwidth_bytes_per_s == link.bandwidth_bytes_per_s


def test_a_joined_node_is_taken_in_only_when_the_plan_is_enough_faster():
    live = ["a", "b"]
    measured = profile({"a": 0.01, "b": 0.05, "c": 0.01})
    planner = Replanner(cluster(("a", "b", "c")), measured, lambda: live)
    current = planner.plan(["a", "b"])
    assert planner.join(current) is None  # nothing joined: the same nodes
    live.append("c")
    grown = planner.join(current)
    assert grown is not None and "c" in {s.node for s in grown.stages}
    assert grown.predicted_tokens_per_s >= (1 + JOIN_GAIN) * current.predicted_tokens_per_s
    slow_c = profile({"a": 0.01, "b": 0.05, "c": 1.0})
    assert Replanner(planner.cluster, slow_c, lambda: live).join(current) is None
    assert Replanner(planner.cluster, None, lambda: live).join(current) is None  # nothing measured


def test_a_pinned_cut_is_priced_as_pinned():
    planner = replanner(EVEN)
    pinned = Plan(stages=(StagePlan("a", "default", 0, 3), StagePlan("b", "default", 3, 5),
                          StagePlan("c", "default", 5, 8)), num_layers=8, micro_batch_size=4, num_microbatches=4,
                  schedule="1f1b", source="pinned")
    priced = planner.priced_pins(pinned)
    assert _cuts(priced) == _cuts(pinned) and priced.source == "pinned" and priced.predicted_step_s > 0


def test_cli_plan_and_up_plan_through_one_function(tmp_path):
    """`hetlaunch plan YAML --profile P` prints the plan `up` would start with on that profile."""
    config = {"name": "adapt", "model": {"preset": "tiny", "n_layers": 6, "seq_len": 32, "d_model": 32},
              "train": {"micro_batch_size": 4, "num_microbatches": 4, "max_pipelines": 1},
              "compression": {"intra_region": "none", "cross_region": "none", "sync": "none"},
              "nodes": [{"name": n, "device": "cpu"} for n in EVEN]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    parsed = parse_cluster(yaml.safe_dump(config))
    measured = profile(EVEN, layers=8, model=parsed.model.to_spec().describe())  # the tiny GPT's 8 stage layers
    save_profile(measured, tmp_path / "p.json")
    done = run_hetlaunch("plan", str(tmp_path / "c.yaml"), "--profile", str(tmp_path / "p.json"), "--json",
                         timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    plan, _ = Replanner(parsed, measured, lambda: list(EVEN)).first()
    assert printed["step_s"] == plan.predicted_step_s
    assert [(s["node"], *s["layers"]) for p in printed["pipelines"] for s in p["stages"]] == _cuts(plan)
    # offline, without a YAML: the same function with the defaults (auto codecs)
    auto = planned(parsed, plan_for(measured, PlanRequest(4, "1f1b", CompressionConfig())))
    assert auto.compression == CompressionConfig()


def test_cli_plan_of_a_yaml_that_pins_layers_prints_the_pinned_cut_up_runs(tmp_path):
    """`hetlaunch plan` once printed a plan of its own for a YAML with `layers:` pinned (here it
    would have put all 8 layers on every node, 3 pipelines), which `up` never runs; now it prices
    the pinned cut as `up` does, and refuses options that would plan another cut, before measuring."""
    config = {"name": "pins", "model": {"preset": "tiny", "n_layers": 6, "seq_len": 32, "d_model": 32},
              "train": {"micro_batch_size": 4, "num_microbatches": 4, "schedule": "zb-h1"},
              "compression": {"intra_region": "none", "cross_region": "none", "sync": "none"},
              "nodes": [{"name": n, "device": "cpu", "layers": cut} for n, cut in zip(EVEN, ([0, 3], [3, 5], [5, 8]))]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    parsed = parse_cluster(yaml.safe_dump(config))
    measured = profile(EVEN, layers=8, model=parsed.model.to_spec().describe())
    save_profile(measured, tmp_path / "p.json")
    done = run_hetlaunch("plan", str(tmp_path / "c.yaml"), "--profile", str(tmp_path / "p.json"), "--json",
                         timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert [(s["node"], s["layer_start"], s["layer_end"]) for s in printed["stages"]] == [
        ("a", 0, 3), ("b", 3, 5), ("c", 5, 8)]
    assert printed["source"] == "pinned" and printed["schedule"] == "zb-h1"
    up_plan = Replanner(parsed, measured, lambda: list(EVEN)).priced_pins(printed_plan := _pinned(parsed))
    assert printed["predicted_step_s"] == up_plan.predicted_step_s and printed_plan.source == "pinned"
    table = run_hetlaunch("plan", str(tmp_path / "c.yaml"), "--profile", str(tmp_path / "p.json"), timeout=60, cwd=tmp_path)
    assert table.returncode == 0 and "pinned cut" in table.stdout and "0–2" in table.stdout, table.stdout
    refused = run_hetlaunch("plan", str(tmp_path / "c.yaml"), "--profile", str(tmp_path / "p.json"), "--stages", "2",
                            timeout=60, cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "--stages" in refused.stderr and "pins" in refused.stderr
    # a profile of other nodes than the YAML pins: one line, not a traceback
    config["nodes"][2]["name"] = "d"
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(config))
    other = run_hetlaunch("plan", str(tmp_path / "other.yaml"), "--profile", str(tmp_path / "p.json"), timeout=60,
                          cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.strip().count("\n") == 0, other.stderr
    assert "no node d" in other.stderr


def _pinned(parsed) -> Plan:
    from hetlaunch.launcher.planning.plan import pinned_num_layers, static_plan

    return static_plan(parsed, pinned_num_layers(parsed))
