"""train.schedule: interleaved-1f1b and zb-v in the YAML: accepted for one pipeline or several, and
what they cannot run with refused in one line naming the field (launcher/device_schedule_checks.py)."""

from __future__ import annotations

import pytest

from conftest import error_of
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.device_schedule_checks import auto_refusal
from hetlaunch.launcher.adapt.replanner import request_for

NODES = "nodes:\n  - {name: a, region: r}\n  - {name: b, region: r}\n"


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved-1f1b"])
def test_accepted_for_one_pipeline_or_several(schedule):
    cluster = parse_cluster(NODES + f"train: {{schedule: {schedule}, max_pipelines: 1, eval_in_bubbles: true}}\n")
    assert cluster.train.schedule == schedule
    # several pipelines, their gradient sync with a codec of its own
    several = parse_cluster(NODES + f"train: {{schedule: {schedule}, max_pipelines: 2}}\n"
                                    f"compression: {{sync: int8, boundaries: {{0: int8}}}}\n")
    assert several.train.max_pipelines == 2
    assert request_for(several).max_pipelines == 2
    # defaults that would act per stage are simply off for these schedules, not errors
    assert parse_cluster(NODES + f"train: {{schedule: {schedule}, rebalance: off}}\nobserve: {{trace_every: 0}}\n")
    # trace.json has a track per node for them (launcher/timeline.py)
    assert parse_cluster(NODES + f"train: {{schedule: {schedule}}}\nobserve: {{trace_every: 5}}\n")


@pytest.mark.parametrize("extra, field", [
    ("train: {schedule: zb-v, outer: {islands: by_region}}\n", "train.outer"),
    ("train: {schedule: interleaved-1f1b, global_batch: 32}\n", "train.global_batch"),
    ("train: {schedule: zb-v, rebalance: live}\n", "train.rebalance"),
    ("train: {schedule: zb-v}\ncompression: {cross_region: int8}\n", "compression.cross_region"),
    ("train: {schedule: interleaved-1f1b}\ncompression: {boundaries: {0: int8}, gradients: fp16}\n",
     "compression.gradients"),
])
def test_refused_in_one_line_naming_the_field(extra, field):
    message = error_of(NODES + extra)
    assert f"cluster.yaml: {field}" in message, message
    assert "not supported with train.schedule" in message, message


def test_pinned_layers_and_windows_are_refused():
    pinned = "nodes:\n  - {name: a, region: r, layers: [0, 3]}\n  - {name: b, region: r, layers: [3, 6]}\n"
    message = error_of(pinned + "train: {schedule: zb-v}\n")
    assert "cluster.yaml: nodes[0].layers" in message and "not supported with train.schedule: zb-v" in message
    # pinned pipelines too (they come with pinned layers): the planner cuts each pipeline's stages
    pipelines = ("nodes:\n  - {name: a, region: r, layers: [0, 6], pipeline: 0}\n"
                 "  - {name: b, region: r, layers: [0, 6], pipeline: 1}\n")
    message = error_of(pipelines + "train: {schedule: zb-v, max_pipelines: 2}\n")
    assert "cluster.yaml: nodes[0].layers" in message and "\n" not in message.strip(), message


@pytest.mark.parametrize("extra, why", [
    ("train: {}\n", None),  # rebalance left at its default: off under a device schedule auto takes
    ("train: {rebalance: off}\n", None),
    ("train: {max_pipelines: 2}\n", None),  # auto prices them only where its plan is one pipeline
    ("train: {rebalance: live}\n", "train.rebalance is live"),
    ("train: {rebalance: restart}\n", "train.rebalance is restart"),
    ("train: {rebalance: true}\n", "train.rebalance is auto"),  # written out: rebalancing asked for
    ("train: {global_batch: 32}\n", "train.global_batch is set"),
    ("train: {outer: {islands: [[a], [b]]}}\n", "train.outer is set"),
    ("train: {}\ncompression: {cross_region: int8}\n", "compression.cross_region is set"),
    ("train: {}\ncompression: {boundaries: {0: int8}}\n", "compression.boundaries is set"),
])
def test_schedule_auto_may_choose_them_where_the_yaml_allows_it(extra, why):
    """`schedule: auto` (the default) is never refused; whether its planner may take a device
    schedule is carried to the plan request, with the reason for its note."""
    cluster = parse_cluster(NODES + extra)
    assert cluster.train.schedule == "auto"
    assert auto_refusal(cluster) == why
    assert request_for(cluster).device_schedules_refused == why


def test_schedule_auto_with_pinned_layers_does_not_choose_them():
    pinned = "nodes:\n  - {name: a, region: r, layers: [0, 3]}\n  - {name: b, region: r, layers: [3, 6]}\n"
    assert auto_refusal(parse_cluster(pinned + "train: {}\n")) == "nodes[0].layers is set"
