"""The steps a generation took but did not record when it ended on a lost node.

`follow` returns as soon as it sees the loss; the survivors' reports of their last steps may
still arrive while they are being stopped. Those, and the steps the lost node never reported,
belong in the record before the next generation starts (once a full run under load ended with
"stages finished but only 59 of 60 steps reported"). Fixed steps, no timing: reports are put
into a real CoordinatorState in the order that race produces.
"""

from __future__ import annotations

from types import SimpleNamespace

from hetlaunch.launcher.coordinator_state import CoordinatorState
from hetlaunch.launcher.job_driver import _late_steps
from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.launcher.run_record import StepAggregator
from hetlaunch.protos import control_pb2 as pb

NODES = ["a", "b", "c", "d"]  # two pipelines: a -> b and c -> d


def _plan() -> Plan:
    stages = (StagePlan("a", "r", 0, 2, pipeline=0), StagePlan("b", "r", 2, 4, pipeline=0),
              StagePlan("c", "r", 0, 2, pipeline=1), StagePlan("d", "r", 2, 4, pipeline=1))
    return Plan(stages=stages, num_layers=4, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                source="pinned", pipeline_microbatches=(2, 2))


def _metrics(node: str, step: int) -> pb.StepMetrics:
    stage = NODES.index(node) % 2
    return pb.StepMetrics(step=step, stage_index=stage, has_loss=stage == 1, loss=1.0 + step, step_s=0.1,
                          tokens=8 if stage == 0 else 0, pipeline_index=NODES.index(node) // 2)


def test_reports_that_arrive_after_the_loss_and_the_lost_nodes_missing_ones_are_recorded_in_order():
    state = CoordinatorState(NODES)
    generation = state.begin_generation()
    aggregator = StepAggregator(_plan())
    # What follow() took before it saw d lost: step 5 complete, step 6 from a and b only.
    assert aggregator.add("a", _metrics("a", 5)) is None
    assert aggregator.add("b", _metrics("b", 5)) is None
    assert aggregator.add("c", _metrics("c", 5)) is None
    assert aggregator.add("d", _metrics("d", 5)) is not None
    assert aggregator.add("a", _metrics("a", 6)) is None
    assert aggregator.add("b", _metrics("b", 6)) is None
    # Arriving after follow() returned, while the survivors were stopped: c's step 6 (d never
    # reported it), then the whole step 7 from the survivors but d, and step 8 that a and c began.
    for node, step in [("c", 6), ("a", 7), ("b", 7), ("c", 7), ("a", 8), ("c", 8)]:
        state.report_step(node, generation, _metrics(node, step))
    late = _late_steps(SimpleNamespace(state=state), aggregator, before=8)  # the replicas hold step 8
    assert [r.step for r in late] == [6, 7]
    assert [r.missing for r in late] == [["d"], ["d"]]
    assert late[0].loss == 7.0  # pipeline 0's last stage reported it
    assert not state.steps_pending()  # every late report was taken


def test_a_late_report_that_completes_a_step_records_it_whole():
    state = CoordinatorState(NODES)
    generation = state.begin_generation()
    aggregator = StepAggregator(_plan())
    for node in ["a", "b", "c"]:
        aggregator.add(node, _metrics(node, 3))
    state.report_step("d", generation, _metrics("d", 3))
    late = _late_steps(SimpleNamespace(state=state), aggregator, before=4)
    assert [r.step for r in late] == [3]
    assert not late[0].missing
