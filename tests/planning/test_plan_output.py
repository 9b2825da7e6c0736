"""What the plan output says: why a node is left out, memory in a unit that fits, user text printed verbatim."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from plan_reference import GiB, uniform_profile

from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.launcher.planning.planner import format_bytes, plan
from hetlaunch.launcher.planning.profile_file import Profile
from hetlaunch.launcher.progress import print_plan, print_planner_result, print_summary

MiB = 2**20


def with_node(profile: Profile, index: int, **update) -> Profile:
    nodes = list(profile.nodes)
    nodes[index] = nodes[index].model_copy(update=update)
    return profile.model_copy(update={"nodes": nodes})


def used(result) -> set[str]:
    return {s.node for p in result.pipelines for s in p.cost.stages}


def console() -> Console:
    return Console(file=io.StringIO(), width=200)


# --- why a node is left out ---------------------------------------------------------------


def test_too_little_memory_names_capacity_and_one_layer_need():
    # uniform_profile layers: 1 MiB of parameters (4 MiB with gradients and AdamW) and 1 MiB of
    # activations per micro-batch; a one-layer last stage under 1F1B keeps one in flight: 5 MiB.
    profile = with_node(uniform_profile([1, 1, 1, 1], ["a"] * 4), 3, memory_bytes=4.1 * MiB)
    result = plan(profile, 8)
    assert used(result) == {"n0", "n1", "n2"}
    why = result.excluded["n3"]
    assert why.startswith("left out, too little memory"), why
    assert "4.10 MiB" in why and "needs 5.00 MiB" in why and "1F1B" in why


def test_too_little_memory_counts_the_schedules_micro_batches_in_flight():
    # GPipe keeps all 8 micro-batches in flight on every stage: 4 + 8 x 1 MiB for one layer.
    profile = with_node(uniform_profile([1, 1, 1, 1], ["a"] * 4), 3, memory_bytes=11 * MiB)
    why = plan(profile, 8, "gpipe").excluded["n3"]
    assert "too little memory" in why and "11.0 MiB" in why and "needs 12.0 MiB" in why
    assert "8 micro-batches in flight under GPipe" in why
    assert not plan(profile, 8).excluded.get("n3", "").startswith("left out, too little memory"), \
        "under 1F1B the same node has room for a one-layer last stage"


def test_too_slow_names_the_factor_and_the_slowest_node_used():
    profile = uniform_profile([1, 0.8, 1, 0.02], ["a"] * 4)
    result = plan(profile, 8)
    assert used(result) == {"n0", "n1", "n2"}
    why = result.excluded["n3"]
    # 500 ms per layer against n1's 12.5 ms: the slowest node the plan uses, not the fastest.
    assert why.startswith("left out, too slow: 40.0x slower per layer than the slowest node used"), why
    assert "500 ms against 12.5 ms on n1" in why


def test_slow_link_is_compared_with_the_plans_links():
    profile = uniform_profile([1, 1, 1, 1], ["a", "a", "a", "b"], cross_bandwidth=1e5, cross_latency=0.02)
    result = plan(profile, 8)
    assert used(result) == {"n0", "n1", "n2"}
    why = result.excluded["n3"]
    assert why.startswith("left out, behind a slow link"), why
    assert "100 kB/s" in why and "10.0 GB/s" in why


def test_slow_link_by_latency():
    profile = uniform_profile([1, 1, 1, 1], ["a", "a", "a", "b"], cross_bandwidth=1e10, cross_latency=1.0)
    why = plan(profile, 8).excluded["n3"]
    assert why.startswith("left out, behind a slow link: its lowest-latency link"), why
    assert "1.00 s" in why and "0.010 ms" in why


def test_slow_link_when_the_plan_is_one_node():
    # Nothing to compare with: the link is weighed against the compute it would split.
    profile = uniform_profile([1, 1], ["a", "b"], cross_bandwidth=1e5, cross_latency=0.02)
    result = plan(profile, 8)
    assert used(result) == {"n0"}
    why = result.excluded["n1"]
    assert why.startswith("left out, behind a slow link: 100 kB/s and 20.0 ms latency to n0"), why
    assert "10.5 s to arrive" in why and "80.0 ms" in why


def test_short_of_memory_for_a_stage_as_large_as_the_plans():
    # 6 MiB hold one layer (5 MiB), not two (10 MiB); the plan's stages hold 2 or 3 layers. (With
    # 8 micro-batches a 1-layer stage on it pays, and it is used.)
    profile = with_node(uniform_profile([1, 1, 1, 1], ["a"] * 4), 3, memory_bytes=6 * MiB)
    why = plan(profile, 2).excluded["n3"]
    assert why.startswith("left out, short of memory: its 6.00 MiB hold at most 1 layer"), why
    assert "at least 2" in why


def test_more_nodes_than_layers():
    result = plan(uniform_profile([1] * 6, ["a"] * 6, num_layers=4), 8)
    assert len(used(result)) == 4
    for why in result.excluded.values():
        assert why.startswith("left out, more nodes than layers: every stage of the plan already holds a single "
                              "layer (4 layers)"), why


def test_stage_count_asked_for():
    result = plan(uniform_profile([1] * 4, ["a"] * 4), 8, stages=2)
    assert len(result.excluded) == 2
    assert all(why == "left out: the plan has the 2 stages per pipeline asked for" for why in result.excluded.values())


def test_one_micro_batch():
    result = plan(uniform_profile([1] * 3, ["a"] * 3), 1)
    assert used(result) == {"n0"}
    assert all("with 1 micro-batch per step" in why for why in result.excluded.values())


def test_generic_reason_only_when_nothing_specific_applies():
    # Equal nodes, 2 micro-batches: three stages pay, a fourth only adds fill and links.
    result = plan(uniform_profile([1] * 4, ["a"] * 4), 2)
    assert len(used(result)) == 3
    for why in result.excluded.values():
        assert why.startswith("left out: the plan is faster without it, though it is not noticeably slower"), why


def test_first_reason_that_applies_wins():
    # Both slow and without room for one layer: memory is named, it rules the node out whatever its speed.
    profile = with_node(uniform_profile([1, 1, 1, 0.02], ["a"] * 4), 3, memory_bytes=1 * MiB)
    assert plan(profile, 8).excluded["n3"].startswith("left out, too little memory")


def test_no_reason_is_the_old_generic_one():
    profile = uniform_profile([1, 1, 1, 0.02], ["a", "a", "a", "b"], cross_bandwidth=1e5)
    for why in plan(profile, 8).excluded.values():
        assert "too slow, too little memory, or behind a slow link" not in why


# --- memory in a unit that fits -----------------------------------------------------------


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (999, "999 B"), (1000, "0.977 KiB"), (1023.9, "1.00 KiB"), (1536, "1.50 KiB"),
    (12.3 * MiB, "12.3 MiB"), (0.005 * GiB, "5.12 MiB"), (4 * GiB, "4.00 GiB"), (123.4 * GiB, "123 GiB"),
    (80 * GiB, "80.0 GiB"), (2 * 2**40, "2.00 TiB"), (None, "-"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_planner_table_shows_small_memory_in_mib():
    profile = uniform_profile([1, 1], ["a", "a"], memory_gb=0.05)
    result = plan(profile, 8)
    out = console()
    print_planner_result(out, profile, result)
    text = out.file.getvalue()
    assert "memory used/free" in text and "GiB used/free" not in text
    assert "0.00/0.0" not in text
    stage = result.pipelines[0].cost.stages[0]
    assert f"{format_bytes(stage.memory_bytes)}/51.2 MiB" in text
    assert "MiB/51.2 MiB" in text


def test_up_plan_table_shows_memory_in_units_that_fit():
    stages = (StagePlan("n0", "a", 0, 2, compute_s=0.01, link_s=0.001, memory_bytes=12.3 * MiB,
                        capacity_bytes=4 * GiB),
              StagePlan("n1", "a", 2, 4, compute_s=0.01, memory_bytes=300, capacity_bytes=80 * GiB))
    out = console()
    print_plan(out, Plan(stages=stages, num_layers=4, micro_batch_size=2, num_microbatches=4, schedule="1f1b",
                         source="planned"))
    text = out.file.getvalue()
    assert "memory used/free" in text
    assert "12.3 MiB/4.00 GiB" in text and "300 B/80.0 GiB" in text


# --- user text printed as plain text ------------------------------------------------------

def test_planner_result_prints_brackets_verbatim():
    # A profile file refuses such names (they follow the YAML's name rules); the printer must not
    # depend on that: names are put in unvalidated here (model_copy does not validate).
    profile = uniform_profile([1, 1, 1, 0.02], ["eu"] * 4)
    names = {"n0": "gpu[/bold]", "n1": "[bold red]loud", "n2": "plain", "n3": "slow[x]"}
    profile = profile.model_copy(update={"nodes": [n.model_copy(update={"name": names[n.name]})
                                                   for n in profile.nodes]})
    result = plan(profile, 8)
    assert "slow[x]" in result.excluded
    out = console()
    print_planner_result(out, profile, result)
    text = out.file.getvalue()
    for name in ("gpu[/bold]", "[bold red]loud", "slow[x]"):
        assert name in text, name
    assert f"slow[x]: {result.excluded['slow[x]']}" in text
    out = console()
    print_planner_result(out, profile, result, as_json=True)
    assert "gpu[/bold]" in out.file.getvalue() and "slow[x]" in out.file.getvalue()


def test_up_plan_prints_brackets_verbatim():
    stages = (StagePlan("gpu[/bold]", "eu[x]", 0, 2, compute_s=0.01, link_s=0.001, memory_bytes=MiB,
                        capacity_bytes=GiB),
              StagePlan("[bold red]loud", "a:smile:b", 2, 4, compute_s=0.01, memory_bytes=MiB, capacity_bytes=GiB))
    excluded = {"[x]": "left out: reason with [/bold] and [x] and :smile:", "n[/]": "[/bold]"}
    the_plan = Plan(stages=stages, num_layers=4, micro_batch_size=2, num_microbatches=4, schedule="1f1b",
                    source="planned", predicted_step_s=0.1, predicted_tokens_per_s=100.0,
                    bottleneck="compute on gpu[/bold]", excluded=excluded)
    out = console()
    print_plan(out, the_plan)
    text = out.file.getvalue()
    for piece in ("gpu[/bold]", "eu[x]", "[bold red]loud", "a:smile:b", "bottleneck: compute on gpu[/bold]",
                  "  [x]: left out: reason with [/bold] and [x] and :smile:", "  n[/]: [/bold]"):
        assert piece in text, piece


def test_summary_prints_brackets_verbatim():
    summary = {"steps": 3, "wall_s": 1.0, "first_loss": 2.0, "final_loss": 1.0, "mean_tokens_per_s": 10.0,
               "links": [{"from": "gpu[/bold]", "to": "[x]", "raw_bytes": 2 * MiB, "wire_bytes": MiB,
                          "compression_ratio": 2.0}],
               "gradient_sync": [{"node": "[bold]n", "raw_bytes": MiB, "wire_bytes": MiB, "mean_blocked_s": 0.0}]}
    out = console()
    print_summary(out, summary, Path("/runs/[/bold]:smile:"))
    text = out.file.getvalue()
    assert text.startswith("done: 3 steps")
    for piece in ("/runs/[/bold]:smile:/metrics.jsonl", "link gpu[/bold] ↔ [x]", "gradient sync from [bold]n"):
        assert piece in text, piece
    assert "dropped" not in text


def test_the_summary_says_how_many_step_reports_the_coordinator_dropped():
    out = console()
    print_summary(out, {"steps": 3, "wall_s": 1.0, "dropped_reports": 70000}, Path("/runs/x"))
    assert "  70,000 step report(s) dropped: more were waiting for the coordinator than it keeps" in out.file.getvalue()


def test_styles_are_kept():
    out = Console(file=io.StringIO(), width=200, force_terminal=True, color_system="standard")
    print_plan(out, Plan(stages=(StagePlan("n0", "a", 0, 4),), num_layers=4, micro_batch_size=2, num_microbatches=4,
                         schedule="1f1b", source="even", excluded={"n[1]": "left out: why"}))
    text = out.file.getvalue()
    assert "\x1b[33mn[1]\x1b[0m: left out: why" in text, "the node of an excluded line stays yellow"
