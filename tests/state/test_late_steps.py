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

import pytest
from rich.console import Console

from hetlaunch.launcher.checkpoint_book import CheckpointBook
from hetlaunch.launcher.coordinator_state import CoordinatorState
from hetlaunch.launcher.events import EventLog
from hetlaunch.launcher.generation import _Reports
from hetlaunch.launcher.job_driver import _late_steps, _record_late_steps
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.planning.plan import Plan, StagePlan
from hetlaunch.launcher.progress import TrainingProgress
from hetlaunch.launcher.run_record import RunRecord, StepRecord
from hetlaunch.launcher.step_aggregator import StepAggregator
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


def test_a_report_sent_again_after_its_step_was_recorded_is_dropped():
    """A report sent again after a timeout, where the first landed after all, must not record the
    step twice."""
    aggregator = StepAggregator(_plan())
    for node in NODES:
        done = aggregator.add(node, _metrics(node, 3))
    assert done is not None and done.step == 3
    assert all(aggregator.add(node, _metrics(node, 3)) is None for node in NODES)  # every copy dropped
    assert 3 not in aggregator.pending
    for node in NODES:
        done = aggregator.add(node, _metrics(node, 4))
    assert done is not None and done.step == 4


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


def test_a_checkpoint_part_that_could_not_be_written_ends_the_run_after_the_steps_before_it(tmp_path):
    """A full disk at the checkpoint of step 5: node a's error part came before b's report of
    step 4 (each agent's reports travel on their own thread, coalesced). The run ends on the
    error, but only once step 4 is recorded: a full suite under load once recorded steps 0-3."""
    import threading

    state = CoordinatorState(NODES)
    generation = state.begin_generation()
    record = RunRecord(tmp_path / "run")
    reports = _Reports(SimpleNamespace(state=state), _plan(), record, EventLog(tmp_path / "run"))
    for step in range(5):
        for node in NODES:
            if (node, step) != ("b", 4):
                state.report_step(node, generation, _metrics(node, step))
    state.report_checkpoint("a", generation, pb.CheckpointPart(step=5, error="No space left on device"))
    late = threading.Timer(0.3, lambda: state.report_step("b", generation, _metrics("b", 4)))
    late.start()
    book = CheckpointBook(tmp_path / "run" / "checkpoints", keep=2, num_layers=4, extra={})
    try:
        with TrainingProgress(Console(file=io.StringIO()), 10) as progress:
            with pytest.raises(JobError, match="cannot write the checkpoint of step 5 on node a: No space left"):
                reports.take_checkpoints(book, progress, None)
    finally:
        late.join()
    assert [r.step for r in record.records] == [0, 1, 2, 3, 4]


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
    summary = record.summarize()  # the steps taken, not only those recorded (399 of 400 were said; a review)
    assert summary["steps"] == 6 and summary["recorded_steps"] == 4
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


def _late_eval(node: str, step: int, loss: float) -> pb.StepMetrics:
    return pb.StepMetrics(step=step, eval_only=True, has_eval_loss=True, eval_loss=loss)


def test_a_step_whose_held_out_loss_comes_later_waits_for_it_and_keeps_its_training_loss_if_it_never_comes(tmp_path):
    """Evaluation in the bubbles: the last stages report step 4 at once (`eval_follows`), and its
    held-out loss in reports of their own during step 5. Step 4 is recorded once both came; when
    step 5 fails before they do, step 4 is recorded with its training loss, its held-out loss
    awaited; held back for the next generation, whose last stages' late reports complete it."""
    aggregator = StepAggregator(_plan())
    for node in NODES:
        metrics = _metrics(node, 4)
        metrics.eval_follows = node in ("b", "d")
        assert aggregator.add(node, metrics) is None  # every stage reported: the held-out loss has not
    assert aggregator.add("b", _late_eval("b", 4, 3.0)) is None
    record = aggregator.add("d", _late_eval("d", 4, 5.0))
    assert record is not None and record.step == 4 and record.eval_loss == 4.0 and record.loss == 5.0
    # Step 5's reports came, then step 6 failed before its E's measured step 5's held-out loss.
    for node in NODES:
        metrics = _metrics(node, 5)
        metrics.eval_follows = node in ("b", "d")
        aggregator.add(node, metrics)
    (late,) = aggregator.incomplete(before=6)
    assert late.step == 5 and late.loss == 6.0 and late.eval_loss is None and late.eval_awaited and not late.missing

    record = RunRecord(tmp_path)
    record.hold_for_eval(late)
    assert record.next_step == 6 and record.accounted() == 1 and record.give_up_before(6, since=5) == []
    assert not (tmp_path / "metrics.jsonl").read_text()  # kept back for its held-out loss
    after = StepAggregator(_plan(), carried=record.awaiting_eval)  # the next generation, first step measures it
    assert after.add("b", _late_eval("b", 5, 2.0)) is None
    done = after.add("d", _late_eval("d", 5, 2.5))
    assert done is late and done.eval_loss == 2.25 and not done.eval_awaited
    record.add(done)
    record.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"eval_loss": 2.25' in lines[0]


def test_a_held_record_whose_held_out_loss_never_comes_is_written_without_it(tmp_path):
    aggregator = StepAggregator(_plan())
    for node in NODES:
        metrics = _metrics(node, 2)
        metrics.eval_follows = node in ("b", "d")
        aggregator.add(node, metrics)
    (late,) = aggregator.incomplete(before=3)
    record = RunRecord(tmp_path)
    record.hold_for_eval(late)
    assert record.rewind(3) == 0 and record.awaiting_eval is late  # the restore is after it: still held
    record.close()  # the run ends (e.g. `down`) before another generation measured it
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"step": 2' in lines[0] and "eval_loss" not in lines[0]
    again = RunRecord(tmp_path / "again")
    again.hold_for_eval(late)
    assert again.rewind(2) == 0 and again.awaiting_eval is None  # restored before it: step 2 runs again


def test_the_summary_gives_no_island_losses_when_the_run_ended_synchronous(tmp_path):
    """Islands down to one after a lost node go on synchronous: the summary showed the islands' losses of
    long before beside the final loss (a hostile review). Their last losses are the last step's, or none."""
    def island(step: int, losses: list[float]) -> StepRecord:
        outer = {"launched": 1, "applied": 1, "blocked_s": 0.0, "bytes": [100, 50]}
        return StepRecord(step, 3.0, 1000.0, 0.1, [], islands={"losses": losses, "outer": outer})

    record = RunRecord(tmp_path / "run")
    record.add(island(0, [3.3, 3.7]))
    record.add(island(1, [3.2, 3.6]))
    assert record.summarize()["outer"]["final_island_losses"] == [3.2, 3.6]
    record.add(StepRecord(2, 2.9, 1000.0, 0.1, []))  # synchronous from here
    assert record.summarize()["outer"]["final_island_losses"] == []


def test_a_report_of_a_node_the_plan_does_not_use_is_dropped():
    """A node that joined as a spare reported a step of the current generation: a KeyError in the
    aggregator ended `up` with a traceback (a hostile review)."""
    aggregator = StepAggregator(_plan())
    assert aggregator.add("spare", _metrics("a", 5)) is None
    for node in NODES:
        record = aggregator.add(node, _metrics(node, 5))
    assert record is not None and record.step == 5 and not record.missing


def test_steps_only_one_stage_reports_are_held_within_a_bound():
    """An agent reporting step numbers no other stage reaches had each held forever (a review)."""
    from hetlaunch.launcher.step_aggregator import MAX_PENDING_STEPS

    aggregator = StepAggregator(_plan())
    for step in range(MAX_PENDING_STEPS + 500):
        aggregator.add("a", _metrics("a", 10**6 + step))
    assert len(aggregator.pending) == MAX_PENDING_STEPS
    for node in NODES:  # a real step still completes
        record = aggregator.add(node, _metrics(node, 5))
    assert record is not None and record.step == 5


def test_late_evaluations_of_steps_that_never_complete_are_held_within_a_bound():
    from hetlaunch.launcher.step_aggregator import MAX_PENDING_STEPS

    aggregator = StepAggregator(_plan())
    for step in range(MAX_PENDING_STEPS + 500):
        metrics = _metrics("b", 10**6 + step)
        metrics.eval_only = True
        aggregator.add("b", metrics)
    assert len(aggregator.late_evals) == MAX_PENDING_STEPS
