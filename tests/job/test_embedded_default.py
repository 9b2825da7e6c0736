"""The embedded default (`hetlaunch up cluster_examples/local.yaml`) shows what hetlaunch is for:
its nodes' memory caps leave no node, and no pair inside one region, room for the model, so
the plan the planner makes from a real profile of it is an uneven pipeline across the regions,
with a codec on the slow link wherever that link is slower than the stages' compute."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, hetlaunch_env, run_hetlaunch


@pytest.mark.solo
@pytest.mark.timeout(300)
def test_the_embedded_defaults_plan_is_an_uneven_pipeline_across_the_regions(tmp_path):
    example = REPO / "cluster_examples" / "local.yaml"
    profile = tmp_path / "profile.json"
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))  # profiled here, not read from a cache
    done = run_hetlaunch("profile", str(example), "-o", str(profile), "--run-dir", str(tmp_path / "run"), timeout=240,
                         env=env)
    assert done.returncode == 0, done.stderr
    out = run_hetlaunch("plan", "--profile", str(profile), str(example), "--json", timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert len(plan["pipelines"]) == 1
    stages = plan["pipelines"][0]["stages"]
    regions = [s["region"] for s in stages]
    assert len(stages) >= 3 and len(set(regions)) == 2, stages  # memory allows no fewer; each region has two nodes
    assert len({s["layers"][1] - s["layers"][0] for s in stages}) > 1, "an uneven cut"
    crossings = [s for s, nxt in zip(stages, stages[1:]) if s["region"] != nxt["region"]]
    assert crossings
    for s in crossings:  # the link the example slows to 50 Mbit/s
        if s["link_uncompressed_s"] > 1.2 * max(t["compute_s"] for t in stages):
            assert s["codec"] != "none", s
    assert all(s["memory_bytes"] <= s["capacity_bytes"] for s in stages)
