"""An agent's report whose attempt timed out is sent again while the coordinator is not gone.

Just after `up` is continued, its coordinator works through what piled up while it was stopped,
and a report whose attempt times out then was dropped: the probe found the coordinator running,
not stopped, and reports were sent again only to a stopped one (a review; a dropped result can
leave the run waiting on it). A real agent object calls a real gRPC server here, which answers
the first attempt too late, as such a coordinator does; the attempt's 30 s is scaled down."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime import agent_job
from hetlaunch.runtime.agent_job import Agent

pytestmark = pytest.mark.timeout(60)


class _LateAnswers(control_pb2_grpc.CoordinatorServicer):
    """Answers the first `late` calls of ReportResult after `late_s`, the others at once."""

    def __init__(self, late: int, late_s: float):
        self.late, self.late_s, self.calls, self.lock = late, late_s, 0, threading.Lock()

    def ReportResult(self, request, context):
        with self.lock:
            self.calls += 1
            late = self.calls <= self.late
        if late:
            time.sleep(self.late_s)
        return pb.ReportResultResponse()


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    control_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _call_once(address: str, tmp_path) -> float:
    agent = Agent(address, "token", "n1", work_dir=tmp_path)
    started = time.monotonic()
    try:
        agent._call("ReportResult", pb.ReportResultRequest(agent_id="x", ok=True))
        return time.monotonic() - started
    finally:
        agent.finished.set()
        agent.probe.close()
        agent.channel.close()


@pytest.fixture
def slow_coordinator():
    servicer = _LateAnswers(late=1, late_s=1.5)
    server, address = _serve(servicer)
    yield servicer, address
    server.stop(None).wait()


def test_a_result_not_answered_in_time_by_a_running_coordinator_is_sent_again(slow_coordinator, tmp_path,
                                                                               monkeypatch, capfd):
    monkeypatch.setattr(agent_job, "REPORT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(agent_job, "RESEND_PAUSE_S", 0.05)
    servicer, address = slow_coordinator
    _call_once(address, tmp_path)
    err = capfd.readouterr().err
    assert "ReportResult not answered (DEADLINE_EXCEEDED): sending it again until it is" in err, err
    assert "ReportResult answered at attempt " in err, err  # 2, or 3 where the machine is slow
    assert servicer.calls >= 2


def test_a_running_coordinator_that_never_answers_in_time_gets_a_few_more_tries_not_endless_ones(
        tmp_path, monkeypatch, capfd):
    """The relay thread or the command loop waits on a report: sent again without end to a
    coordinator that runs but never answers it in time, it held them for good (a review)."""
    monkeypatch.setattr(agent_job, "REPORT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(agent_job, "RESEND_PAUSE_S", 0.05)
    servicer = _LateAnswers(late=10**6, late_s=0.6)
    server, address = _serve(servicer)
    try:
        _call_once(address, tmp_path)
    finally:
        server.stop(None).wait()
    err = capfd.readouterr().err
    assert "ReportResult failed (DEADLINE_EXCEEDED)" in err, err
    assert servicer.calls == 1 + agent_job.RUNNING_RESENDS


def test_a_report_to_a_coordinator_that_is_gone_is_not_sent_again(tmp_path, capfd):
    """Refused: gone, so the report fails once (the heartbeat loop ends the agent)."""
    import socket
    with socket.socket() as bound:  # bound, never listening: connections to it are refused, and no
        bound.bind(("127.0.0.1", 0))  # other test can take the port meanwhile
        took = _call_once(f"127.0.0.1:{bound.getsockname()[1]}", tmp_path)
    err = capfd.readouterr().err
    assert "ReportResult failed (UNAVAILABLE)" in err and "sending it again" not in err, err
    assert took < 10, took
