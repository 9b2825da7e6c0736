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
        self.ended = False

    def alive(self):
        return not self.ended

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


def test_a_late_snapshot_to_an_ended_worker_never_reaches_the_next_one():
    """The recovery race, found: an abort's snapshot, late on its own thread, was written through
    the ended worker's control descriptor after that number had been reused by the next worker's
    pipe; the next task's worker snapshotted itself and exited with code 5 ("profiling on node n2
    failed: the worker exited with code 5"). Here the number is taken by a pipe of the test's own
    (the way the next worker's pipe took it), and nothing may arrive there."""
    import os

    from hetlaunch.runtime.supervisor import WorkerProcess

    ended = WorkerProcess()
    number = ended.process.stdin.fileno()
    ended.kill()
    ended.wait()
    opened = []
    while number not in {fd for pair in opened for fd in pair} and len(opened) < 50:
        opened.append(os.pipe())
    reader, writer = next(pair for pair in opened if number in pair)
    try:
        assert writer == number or reader == number
        if writer == number:
            ended.snapshot("/nowhere", timeout_s=0.2)  # what the late abort's thread does
            os.set_blocking(reader, False)
            try:
                leaked = os.read(reader, 1 << 16)
            except BlockingIOError:
                leaked = b""
            assert leaked == b"", "the ended worker's snapshot was written into another pipe"
        else:  # the number came back as a read end: a write there fails either way; try once more
            ended.snapshot("/nowhere", timeout_s=0.2)
    finally:
        for pair in opened:
            for fd in pair:
                os.close(fd)


def _probe_task() -> wpb.WorkerTask:
    return wpb.WorkerTask(profile=pb.Profile(rendezvous=pb.Rendezvous(rank=0, world_size=3)))


def _probe_running(generation: int, tmp_path: Path) -> tuple[TaskRelay, _Worker]:
    relay, worker = _relay_running(pb.AGENT_STATE_PROFILING, generation, tmp_path)
    relay.running_probe = True
    return relay, worker


def test_a_link_probe_abort_kills_the_probe_of_its_generation_only(tmp_path):
    """A peer's worker died mid-probe: the survivors' probes are killed, not waited for (gloo's
    connect can wait five times the rendezvous timeout for a dead peer)."""
    relay, worker = _probe_running(3, tmp_path)
    relay.abort_probe(2)
    relay.abort_probe(4)
    assert worker.stopped == []
    assert relay.abort_probe(3) == "its worker killed"
    assert worker.stopped == [("kill", None)]


def test_a_link_probe_abort_never_stops_a_stage_or_a_profiling_run_that_probes_nothing(tmp_path):
    relay, worker = _relay_running(pb.AGENT_STATE_TRAINING, 3, tmp_path)
    relay.abort_probe(3)
    relay, timing = _relay_running(pb.AGENT_STATE_PROFILING, 3, tmp_path)  # layers timed, or device and memory
    assert relay.abort_probe(3) == "no probe of that generation runs"
    assert worker.stopped == [] and timing.stopped == []


def test_a_link_probe_that_ended_is_left_to_report_how(tmp_path):
    """A probe whose worker died or failed reports that itself (a death is what tells the
    coordinator to probe again); one that ended well may be the next task's worker already."""
    relay, worker = _probe_running(3, tmp_path)
    worker.ended = True
    assert relay.abort_probe(3) == "it had ended"
    relay, kept = _probe_running(3, tmp_path)
    relay.spare = kept
    assert relay.abort_probe(3) == "it had ended"
    assert worker.stopped == [] and kept.stopped == []


def test_a_link_probe_aborted_before_it_started_never_starts_and_reports_nothing(tmp_path):
    """The abort travels beside the command, on the reader thread, and can overtake it while the
    command waits in the agent's queue: the probe must not start on a group that is broken."""
    calls = []
    relay = TaskRelay("n2", lambda method, request: calls.append(method), None, wpb.StoreAccess(), None, [], tmp_path)
    relay.abort_probe(5)
    relay.run(_probe_task(), 5, pb.AGENT_STATE_PROFILING)
    relay.run(_probe_task(), 4, pb.AGENT_STATE_PROFILING)
    assert relay.worker is None and relay.spare is None and calls == []


def test_a_link_probe_abort_leaves_the_next_generations_probe_and_layer_timing_alone(tmp_path):
    relay = TaskRelay("n2", lambda method, request: None, None, wpb.StoreAccess(), None, [], tmp_path)
    relay.abort_probe(5)
    started = []
    relay._take_worker = lambda: started.append(True) or _Started()
    assert relay._start(_probe_task(), 6, pb.AGENT_STATE_PROFILING) is not None
    assert relay._start(wpb.WorkerTask(profile=pb.Profile(measure_layers=True)), 5, pb.AGENT_STATE_PROFILING) is not None
    assert started == [True, True]


class _Started:
    def start(self, task):
        return self
