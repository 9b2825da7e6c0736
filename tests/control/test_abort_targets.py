"""An abort stops the stage it was sent for and nothing else: not a later generation's worker, and
not the profiling run that recovery starts, in the same generation, on the survivors (a late abort
reaching it made it exit 5 and failed `up` with "profiling on node n2 failed")."""

from pathlib import Path

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import worker_pb2 as wpb
from hetlaunch.runtime.task_relay import TaskRelay


class _Worker:
    """Stands in for the worker process: records how it was stopped."""

    def __init__(self):
        self.stopped = []

    def snapshot(self, directory):
        self.stopped.append(("snapshot", directory))

    def kill(self):
        self.stopped.append(("kill", None))


def _relay_running(state: int, generation: int, tmp_path: Path) -> tuple[TaskRelay, _Worker]:
    relay = TaskRelay("n2", lambda method, request: None, None, wpb.StoreAccess(), None, [], tmp_path)
    worker = _Worker()
    relay.worker, relay.busy_state, relay.generation = worker, state, generation
    return relay, worker


def test_an_abort_stops_the_stage_of_its_generation(tmp_path):
    relay, worker = _relay_running(pb.AGENT_STATE_TRAINING, 3, tmp_path)
    relay.stop("/snap", 3, stage_only=True)
    assert worker.stopped == [("snapshot", "/snap")]


def test_a_late_abort_never_stops_a_profiling_run_of_the_same_generation(tmp_path):
    relay, worker = _relay_running(pb.AGENT_STATE_PROFILING, 3, tmp_path)
    relay.stop("/snap", 3, stage_only=True)
    relay.stop("", 3, stage_only=True)
    assert worker.stopped == []


def test_a_late_abort_never_stops_the_next_generations_stage(tmp_path):
    relay, worker = _relay_running(pb.AGENT_STATE_TRAINING, 4, tmp_path)
    relay.stop("/snap", 3, stage_only=True)
    assert worker.stopped == []


def test_a_shutdown_mid_profiling_still_stops_it(tmp_path):
    relay, worker = _relay_running(pb.AGENT_STATE_PROFILING, 3, tmp_path)
    relay.stop()
    assert worker.stopped == [("kill", None)]
