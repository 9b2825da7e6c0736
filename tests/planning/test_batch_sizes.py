"""Micro-batches decided: `train.global_batch`, the planner's choice of micro-batch size and count,
the per-token model behind it and its reported error, offline and in a real `hetlaunch up`."""

from __future__ import annotations

import json
import random

import pytest
import yaml

from conftest import REPO, run_hetlaunch
from hetlaunch.launcher.cluster_config import ClusterConfig
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.planning.batch_sizes import at_size, candidate_sizes, per_token_error
from hetlaunch.launcher.planning.planner import PlanningError, plan, plan_global_batch
from hetlaunch.launcher.planning.profile_file import Profile, save_profile
from plan_reference import random_profile

GiB = 2**30


def with_second_size(profile: Profile, size: int, per_sample: float, fixed: float) -> Profile:
    """Each node also timed at `size`: its layer times follow fixed + per_sample * b (so proportional
    scaling is off by the fixed part)."""
    b0 = profile.micro_batch_size
    nodes = []
    for n in profile.nodes:
        at_b0 = [fixed + per_sample * t * b0 for t in n.layer_seconds]
        at_b = [fixed + per_sample * t * size for t in n.layer_seconds]
        nodes.append(n.model_copy(update={"layer_seconds": at_b0, "layer_seconds_by_size": {size: at_b}}))
    return profile.model_copy(update={"nodes": nodes})


def test_candidate_sizes_are_divisors_up_to_the_profiled_size_largest_first():
    assert candidate_sizes(512, 4) == [4, 2, 1]
    assert candidate_sizes(12, 8) == [6, 4, 3, 2]
    assert candidate_sizes(7, 8) == [7, 1]
    assert candidate_sizes(3, 1) == [1]


def test_at_size_scales_bytes_per_sample_and_interpolates_measured_times():
    profile = random_profile(random.Random(1), 3, 2, 6)  # measured at micro-batch size 4
    two = with_second_size(profile, 1, per_sample=1.0, fixed=0.001)
    at2 = at_size(two, 2)
    assert at2.micro_batch_size == 2
    for layer, scaled in zip(two.layers, at2.layers):
        assert scaled.activation_bytes == round(layer.activation_bytes / 2)
        assert scaled.output_bytes == round(layer.output_bytes / 2)
        assert scaled.param_bytes == layer.param_bytes
    for n, m in zip(two.nodes, at2.nodes):
        # fixed + per-sample work is linear in b: interpolating between 1 and 4 is exact at 2
        expected = [(a + (b - a) / 3) for a, b in zip(n.layer_seconds_by_size[1], n.layer_seconds)]
        assert m.layer_seconds == pytest.approx(expected, rel=1e-12)
        assert m.optimizer_seconds == n.optimizer_seconds
    # Below the smallest measured size: per token from it.
    one_size = at_size(profile, 1)
    assert [n.layer_seconds for n in one_size.nodes] == [[t / 4 for t in n.layer_seconds] for n in profile.nodes]


def test_per_token_error_is_measured_leave_one_out():
    profile = random_profile(random.Random(2), 3, 1, 5)
    assert per_token_error(profile) is None  # one size: nothing to check it against
    exact = with_second_size(profile, 1, per_sample=1.0, fixed=0.0)
    assert per_token_error(exact) == pytest.approx(0.0, abs=1e-12)
    off = with_second_size(profile, 1, per_sample=1.0, fixed=0.002)
    # Predicting size 1 from size 4 per token: (fixed + s) vs (fixed*4 + 4s)/4, and the other way.
    worst = 0.0
    for n in off.nodes:
        at4, at1 = sum(n.layer_seconds), sum(n.layer_seconds_by_size[1])
        worst = max(worst, abs(at4 / 4 - at1) / at1, abs(at1 * 4 - at4) / at4)
    assert per_token_error(off) == pytest.approx(worst, rel=1e-12) and worst > 0.05


@pytest.mark.parametrize("seed", range(6))
def test_global_batch_plan_is_the_best_of_its_candidate_sizes(seed):
    rng = random.Random(seed)
    profile = with_second_size(random_profile(rng, 4, 2, 6), 1, per_sample=1.0, fixed=rng.uniform(0, 0.003))
    chosen = plan_global_batch(profile, 16, max_pipelines=2)
    by_size = {}
    for size in candidate_sizes(16, 4):
        try:
            by_size[size] = plan(at_size(profile, size), 16 // size, max_pipelines=2).tokens_per_s
        except PlanningError:
            pass
    best = max(by_size, key=by_size.get)
    assert chosen.micro_batch_size == best and chosen.tokens_per_s == pytest.approx(by_size[best], rel=1e-12)
    assert chosen.batch.num_microbatches * chosen.batch.micro_batch_size == 16
    assert sum(p.cost.num_microbatches for p in chosen.pipelines) == 16 // best
    assert chosen.batch.per_token_error == pytest.approx(per_token_error(profile))


def test_a_size_too_big_for_memory_is_skipped_for_one_that_fits():
    profile = random_profile(random.Random(3), 2, 1, 4, memory_gb=(0.6, 0.6))
    heavy = profile.model_copy(update={"layers": [l.model_copy(update={"activation_bytes": 250 * 2**20, "param_bytes": 2**20})
                                                  for l in profile.layers]})
    with pytest.raises(PlanningError):
        plan(heavy, 16)  # size 4: too much activation memory in flight
    chosen = plan_global_batch(heavy, 64)
    assert chosen.micro_batch_size < 4
    with pytest.raises(PlanningError):
        plan_global_batch(heavy, 64, num_microbatches=16)  # fixed count: size 4 only


def train_section(**train) -> dict:
    return {"name": "t", "nodes": [{"name": "a", "device": "cpu"}], "train": train}


def test_yaml_global_batch_rules():
    def load(**train):
        return parse_cluster(yaml.safe_dump(train_section(**train)), "c.yaml")

    t = load(global_batch=48, micro_batch_size=8).train
    assert (t.fixed_microbatches, t.profile_size, t.batch_shape()) == (None, 8, (8, 6))
    t = load(global_batch=48, num_microbatches=12).train
    assert (t.fixed_microbatches, t.profile_size, t.batch_shape()) == (12, 4, (4, 12))
    t = load(global_batch=30, micro_batch_size=8).train  # largest divisor up to 8
    assert t.batch_shape() == (6, 5)
    assert load(micro_batch_size=2, num_microbatches=3).train.batch_shape() == (2, 3)
    for bad, words in [({"global_batch": 10, "num_microbatches": 4}, "do not divide"),
                       ({"global_batch": 12, "num_microbatches": 4, "micro_batch_size": 4}, "give two"),
                       ({"global_batch": 12, "pipeline_microbatches": [2, 2]}, "num_microbatches too"),
                       ({"global_batch": 0}, "global_batch")]:
        with pytest.raises(ConfigError, match=words):
            load(**bad)
    assert isinstance(load(global_batch=12), ClusterConfig)


def test_plan_command_global_batch_offline(tmp_path):
    profile = with_second_size(random_profile(random.Random(4), 3, 2, 6), 2, per_sample=1.0, fixed=0.001)
    save_profile(profile, tmp_path / "p.json")
    shown = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--global-batch", "24", "--max-pipelines", "2",
                          timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "global batch 24:" in shown.stdout and "per-token model error" in shown.stdout, shown.stdout
    as_json = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--global-batch", "24", "--json",
                            timeout=120)
    batch = json.loads(as_json.stdout)["batch"]
    assert batch["global_batch"] == 24 and batch["tried_sizes"] == [4, 3, 2, 1]
    assert batch["measured_sizes"] == [2, 4] and batch["per_token_error"] > 0
    assert json.loads(as_json.stdout)["micro_batch_size"] * batch["num_microbatches"] == 24
    refused = run_hetlaunch("plan", "--profile", str(tmp_path / "p.json"), "--global-batch", "0", timeout=60)
    assert refused.returncode != 0 and "global-batch" in refused.stderr


@pytest.mark.timeout(240)
def test_up_with_a_global_batch_profiles_two_sizes_and_trains_at_the_chosen_one(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    cluster["train"] = {"steps": 3, "micro_batch_size": 4, "global_batch": 8, "checkpoint_every": 0}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    result = run_hetlaunch("up", str(tmp_path / "c.yaml"), "--run-dir", str(run_dir), timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "global batch 8:" in result.stdout and "per-token model error" in result.stdout, result.stdout
    profile = json.loads((run_dir / "profile.json").read_text())
    assert profile["micro_batch_size"] == 4
    assert all(set(n["layer_seconds_by_size"]) == {"1"} for n in profile["nodes"])  # the smallest size tried
    summary = json.loads((run_dir / "summary.json").read_text())
    size, count = summary["plan"]["micro_batch_size"], summary["plan"]["num_microbatches"]
    assert size * count == 8 and size in (4, 2, 1)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["loss"] > 0 for r in records)
