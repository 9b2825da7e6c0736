"""Per-stage peak memory, predicted and measured, in the run's summary (launcher/memory_summary.py):
every stage measures its tensors (runtime/memory_limit.py), the summary keeps the largest report
per stage beside the plan's prediction, and the memory balance (first stage's peak activations ÷
the last's) shows how 1F1B loads the pipeline's first stage with more micro-batches."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from torch import nn

from conftest import REPO, hetlaunch_env, run_hetlaunch
from hetlaunch.launcher.memory_summary import memory_summary
from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.launcher.run_record import StepRecord
from hetlaunch.runtime.memory_limit import StageMemory
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import ModelSpec, preset
from hetlaunch.runtime.schedules import schedule_named


def _record(step: int, peaks: list[tuple[str, int, int] | None]) -> StepRecord:
    stages = [{"pipeline": 0, "stage": j, "node": f"n{j}",
               **({"peak_bytes": {"activations": p[1], "used": p[2]}} if p else {})} for j, p in enumerate(peaks)]
    return StepRecord(step=step, loss=1.0, tokens_per_s=1.0, step_s=1.0, stages=stages)


def test_the_summary_keeps_each_stages_largest_report_beside_the_prediction():
    plan = Plan(stages=(StagePlan("n0", "r", 0, 2, memory_bytes=900.0, capacity_bytes=1000.0),
                        StagePlan("n1", "r", 2, 4, memory_bytes=500.0, capacity_bytes=1000.0)),
                num_layers=4, micro_batch_size=1, num_microbatches=2, schedule="1f1b", source="planned")
    records = [_record(0, [None, None]), _record(1, [("n0", 300, 800), ("n1", 100, 450)]),
               _record(2, [("n0", 200, 850), None])]
    memory = memory_summary(plan, records)
    assert [(s["node"], s["predicted_bytes"], s["peak_activation_bytes"], s["peak_used_bytes"])
            for s in memory["stages"]] == [("n0", 900.0, 300, 850), ("n1", 500.0, 100, 450)]
    assert memory["activation_balance"] == [3.0]
    unmeasured = memory_summary(plan, records[:1])
    assert unmeasured["stages"][0]["peak_used_bytes"] is None and unmeasured["activation_balance"] == [None]


def test_where_nodes_run_several_stages_the_balance_is_the_first_nodes_peak_over_the_last_nodes():
    """ZB-V on two nodes: stages n0, n1, n1, n0. Each node measures once, on its first stage's row
    (launcher/part_rows.py); the balance is then n0's peak ÷ n1's, not stage 0's ÷ stage 3's (which
    has no measure of its own)."""
    nodes = ["n0", "n1", "n1", "n0"]
    plan = Plan(stages=tuple(StagePlan(n, "r", j, j + 1, memory_bytes=100.0, capacity_bytes=1000.0)
                             for j, n in enumerate(nodes)),
                num_layers=4, micro_batch_size=1, num_microbatches=4, schedule="zb-v", source="planned")
    stages = [{"pipeline": 0, "stage": 0, "node": "n0", "peak_bytes": {"activations": 300, "used": 700}},
              {"pipeline": 0, "stage": 1, "node": "n1", "peak_bytes": {"activations": 200, "used": 600}},
              {"pipeline": 0, "stage": 2, "node": "n1"}, {"pipeline": 0, "stage": 3, "node": "n0"}]
    memory = memory_summary(plan, [StepRecord(step=0, loss=1.0, tokens_per_s=1.0, step_s=1.0, stages=stages)])
    assert [s["peak_activation_bytes"] for s in memory["stages"]] == [300, 200, None, None]
    assert memory["activation_balance"] == [1.5]


def _activation_bytes_per_microbatch(start: int, end: int, micro_batch_size: int) -> int:
    """What autograd saves for one micro-batch's forward through layers [start, end) of the tiny
    preset (with the loss where the range ends the model), counted here, in this process."""
    bundle = build_model_range(ModelSpec(gpt=preset("tiny")), 0, 6, seed=0)
    layers = nn.Sequential(*bundle.layers)
    tokens = torch.randint(0, 256, (micro_batch_size, preset("tiny").seq_len))
    with torch.no_grad():
        x = layers[:start](tokens) if start else tokens
    if start:
        x.requires_grad_()
    memory = StageMemory(0, torch.device("cpu"))
    memory.attach(layers[start:end])
    with memory.forward(0):
        out = layers[start:end](x)
        if end == len(layers):
            bundle.loss_fn(out, tokens)
    return memory.peak_activation_bytes


@pytest.mark.timeout(300)
def test_up_on_the_embedded_example_reports_each_stages_peak_beside_the_prediction(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "local.yaml").read_text())
    cluster["train"].update(steps=4, checkpoint_every=0)  # its memory caps, profile and plan as they are
    cluster["observe"] = {"trace_every": 0}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(tmp_path / "cache"))
    done = run_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir), timeout=240, env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    plan, memory = summary["plan"], summary["memory"]
    assert plan["schedule"] == "1f1b" and plan["pipeline_microbatches"] == [4]
    stages = memory["stages"]
    assert [(s["node"], s["layers"]) for s in stages] == [(s["node"], [s["layer_start"], s["layer_end"]])
                                                         for s in plan["stages"]]
    for s, planned in zip(stages, plan["stages"]):
        # predicted (parameters, gradients, AdamW state, in-flight activations) beside measured
        assert s["predicted_bytes"] == planned["memory_bytes"] > 0, s
        assert s["peak_activation_bytes"] > 0 and s["peak_used_bytes"] > s["peak_activation_bytes"], s
        assert 0.75 < s["peak_used_bytes"] / s["predicted_bytes"] < 1.25, s
        assert s["peak_used_bytes"] <= s["capacity_bytes"], s  # the node's emulated cap held

    # 1F1B: stage s of S keeps min(S - s, M) micro-batches' activations (or its planned window), the
    # last stage one; each holds per micro-batch what its layers save. That derives each peak.
    num_stages, m = len(stages), cluster["train"]["num_microbatches"]
    held = [schedule_named("1f1b").in_flight(j, num_stages, m, planned["window"])
            for j, planned in enumerate(plan["stages"])]
    assert held[0] == min(num_stages, m) >= 3 and held[-1] == 1  # the example's caps force >= 3 stages
    first, last = stages[0], stages[-1]
    expected = [held[j] * _activation_bytes_per_microbatch(*s["layers"], cluster["train"]["micro_batch_size"])
                for j, s in ((0, first), (num_stages - 1, last))]
    # within 1%: the stage counts the step's whole token batch once (its micro-batches are views of
    # it), as many bytes as the micro-batches in flight hold here each of its own; under load the
    # plan gave the first stage the embedding alone, whose saved ids counted that batch 4 times
    assert first["peak_activation_bytes"] == pytest.approx(expected[0], rel=0.01)
    assert last["peak_activation_bytes"] == pytest.approx(expected[1], rel=0.01)
    assert (first["peak_activation_bytes"] > last["peak_activation_bytes"]) == (expected[0] > expected[1])
    if first["layers"][1] > 1:  # the first stage holds a block, not only the embedding (which saves token ids)
        # >= 3 micro-batches of a block's ~2.1 MB outweigh one of the last stage's, which its 9 MB cap keeps
        # to at most two blocks and the head (~5.0 MB): the first stage's peak is the larger
        assert first["peak_activation_bytes"] > last["peak_activation_bytes"], stages
    assert memory["activation_balance"] == [first["peak_activation_bytes"] / last["peak_activation_bytes"]]
    assert "memory balance (first stage's peak activations ÷ the last's)" in done.stdout

    # every step's report carries each stage's peak so far (all four steps are measured ones)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(stage["peak_bytes"]["used"] > 0 for r in records for stage in r["stages"])
