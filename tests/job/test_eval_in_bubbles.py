"""`hetlaunch up` with evaluation in the bubbles (the default) reports the held-out losses that
evaluation after the step reports, at the same steps, and trains to the same losses; the trace
shows the evaluation forwards inside the steps that carry them, on every stage."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, run_hetlaunch
from hetlaunch.launcher.planning.plan import StagePlan
from hetlaunch.launcher.stage_launch import eval_fills


def _run(tmp_path, in_bubbles: bool) -> tuple[list[dict], dict]:
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    cluster["train"].update(steps=5, checkpoint_every=0, eval_every=2, eval_microbatches=3, eval_in_bubbles=in_bubbles)
    cluster["observe"] = {"trace_every": 1}
    for node, layers in zip(cluster["nodes"], ([0, 1], [1, 3], [3, 4])):  # three stages, pinned
        node["layers"] = layers
    path = tmp_path / f"c-{in_bubbles}.yaml"
    path.write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / f"run-{in_bubbles}"
    result = run_hetlaunch("up", str(path), "--run-dir", str(run_dir), timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    fills = [e for e in events if e["event"] == "eval_fill"]
    assert len(fills) == (1 if in_bubbles else 0)
    if fills:  # placed from the plan's prices: never predicted dearer than evaluating after the step
        assert fills[0]["step_s"] <= fills[0]["step_with_eval_s"] <= fills[0]["after_step_s"]
    return lines, json.loads((run_dir / "trace.json").read_text())


@pytest.mark.timeout(480)
def test_evaluation_in_the_bubbles_reports_what_evaluation_after_the_step_reports(tmp_path):
    after, after_trace = _run(tmp_path, False)
    filled, filled_trace = _run(tmp_path, True)
    assert [r["step"] for r in filled if "eval_loss" in r] == [1, 3, 4]  # after steps 2, 4 and the last
    assert [(r["step"], r.get("eval_loss")) for r in filled] == [(r["step"], r.get("eval_loss")) for r in after]
    assert [r["loss"] for r in filled] == [r["loss"] for r in after]

    def evaluation_spans(trace: dict) -> dict[int, dict[int, list[str]]]:
        found: dict[int, dict[int, list[str]]] = {}
        for e in trace["traceEvents"]:
            if e["ph"] == "X" and e["pid"] == 0 and e["name"].startswith("E"):
                found.setdefault(e["args"]["step"], {}).setdefault(e["tid"], []).append(e["name"])
        return found
    # The evaluation due after step 1 runs in step 2, the one after step 3 in step 4; after the last
    # step (4) it runs after the step, as without the fill.
    assert evaluation_spans(filled_trace) == {step: {stage: ["E0", "E1", "E2"] for stage in range(3)}
                                              for step in (2, 4)}
    assert evaluation_spans(after_trace) == {}


def test_the_fill_is_placed_from_the_plans_prediction():
    """A priced plan: stage 0 waits 5 s for each gradient over its link, so every held-out forward
    fits in that wait; without a prediction (a pinned plan) unit costs place them."""
    priced = [StagePlan("a", "r", 0, 2, compute_s=0.3, link_s=0.0, latency_s=5.0),
              StagePlan("b", "r", 2, 4, compute_s=0.3)]
    fills, report = eval_fills(priced, "1f1b", 4, 2)
    assert report.step_with_eval_s == report.step_s  # free: the forwards sit in the waits
    assert fills[0].split()[:3] == ["F0", "F1", "E0"] and fills[0].split()[-1] != "E1"
    pinned = [StagePlan("a", "r", 0, 2), StagePlan("b", "r", 2, 4)]
    fills, report = eval_fills(pinned, "1f1b", 4, 2)
    assert report.step_s == pytest.approx(4 + 2 - 1)  # unit costs: (M + S - 1) x (forward 1/3 + backward 2/3)
    assert all(text.count("E") == 2 for text in fills)
