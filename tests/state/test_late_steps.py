"""The steps a generation took but did not record when it ended (on a lost node, or at a checkpoint).

`follow` returns as soon as it sees the loss; the survivors' reports of their last steps may
still arrive while they are being stopped. Those, and the steps the lost node never reported,
belong in the record before the next generation starts (once a full run under load ended with
"stages finished but only 59 of 60 steps reported"). Fixed steps, no timing: reports are put
into a real CoordinatorState in the order that race produces.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from hetlaunch.launcher.coordinator_state import CoordinatorState
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.generation import _Reports
from hetlaunch.launcher.job_driver import _late_steps, _record_late_steps
from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.launcher.progress import TrainingProgress
from hetlaunch.launcher.run_record import RunRecord, StepAggregator
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
    late = _late_steps(SimpleNamespace(state=state), aggregator, 6, 8, wait_s=0)  # replicas at step 8
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
    late = _late_steps(SimpleNamespace(state=state), aggregator, 3, 4, wait_s=0)
    assert [r.step for r in late] == [3]
    assert not late[0].missing


def test_a_generation_ending_at_a_checkpoint_first_records_the_steps_before_it(tmp_path):
    """`down` or a switch at the checkpoint of step 4, whose parts came before the reports of
    steps 2 and 3 (they travel on their own thread): those steps are taken before it ends (a
    resumed run once ended with 386 of 400 steps)."""
    state = CoordinatorState(NODES)
    generation = state.begin_generation()
    record = RunRecord(tmp_path / "run")
    reports = _Reports(SimpleNamespace(state=state), _plan(), record, EventLog(tmp_path / "run"))
    for step in range(6):  # steps 4 and 5 too: the stages train on while the checkpoint is committed
        for node in NODES:
            state.report_step(node, generation, _metrics(node, step))
    with TrainingProgress(Console(file=io.StringIO()), 10) as progress:
        reports.catch_up(4, progress, None, timeout_s=30)
        assert record.next_step >= 4 and [r.step for r in record.records] == list(range(record.next_step))
        # Nothing more to come after step 5: it waits its bound and records only what came.
        reports.catch_up(9, progress, None, timeout_s=0.5)
        assert [r.step for r in record.records] == list(range(6))


def test_a_resumed_run_accounts_for_steps_its_checkpoint_holds_but_its_metrics_do_not(tmp_path):
    first = RunRecord(tmp_path / "run")
    aggregator = StepAggregator(_plan())
    for step in [0, 1, 2]:  # the run stopped at the checkpoint of step 5 before steps 3 and 4 were reported
        for node in NODES:
            done = aggregator.add(node, _metrics(node, step))
        first.add(done)
    first.close()
    resumed = RunRecord(tmp_path / "run", resume_at=5)
    assert [r.step for r in resumed.records] == [0, 1, 2] and resumed.unrecorded == [3, 4]
    assert resumed.accounted() == 5 and resumed.next_step == 3


def test_reports_still_on_their_way_are_waited_for_within_the_bound():
    import threading

    state = CoordinatorState(NODES)
    generation = state.begin_generation()
    aggregator = StepAggregator(_plan())
    arrived = threading.Event()

    def late_reports():  # step 2's reports, sent once the caller is waiting
        for node in NODES:
            state.report_step(node, generation, _metrics(node, 2))
        arrived.set()

    timer = threading.Timer(0.2, late_reports)
    timer.start()
    late = _late_steps(SimpleNamespace(state=state), aggregator, 2, 3, wait_s=60)
    timer.join()
    assert arrived.is_set() and [r.step for r in late] == [2] and not late[0].missing


def test_steps_given_up_on_are_accounted_once_and_run_again_after_a_rewind(tmp_path):
    record = RunRecord(tmp_path / "run")
    aggregator = StepAggregator(_plan())
    for step in [0, 1, 2, 5]:  # 3 and 4 never came
        for node in NODES:
            done = aggregator.add(node, _metrics(node, step))
        record.add(done)
    assert record.give_up_before(6, since=3) == [3, 4]
    assert record.give_up_before(6, since=3) == []  # once
    assert record.accounted() == 6 and record.next_step == 6
    record.rewind(4)  # a restore from step 4: step 4 on runs again, and must be reported then
    assert record.unrecorded == [3] and record.accounted() == 4 and record.next_step == 3


def test_a_resumed_run_with_a_gap_still_records_the_next_generations_late_steps(tmp_path):
    """Records 0-2 of an earlier run, resumed at its checkpoint of step 5 (3, 4 unrecorded); the
    new generation takes steps 5-7 and loses a node: its late steps are recorded after the gap."""
    first = RunRecord(tmp_path / "run")
    aggregator = StepAggregator(_plan())
    for step in [0, 1, 2]:
        for node in NODES:
            done = aggregator.add(node, _metrics(node, step))
        first.add(done)
    first.close()
    record = RunRecord(tmp_path / "run", resume_at=5)
    state = CoordinatorState(NODES)
    generation = state.begin_generation()
    aggregator = StepAggregator(_plan())
    for step in [5, 6, 7]:
        for node in ["a", "b", "c"]:  # d lost before reporting any of them
            state.report_step(node, generation, _metrics(node, step))
    _record_late_steps(SimpleNamespace(state=state), aggregator, record, 5, 8, wait_s=0)
    assert [r.step for r in record.records] == [0, 1, 2, 5, 6, 7] and record.accounted() == 8
