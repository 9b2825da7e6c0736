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


class _SlowFirstAnswer(control_pb2_grpc.CoordinatorServicer):
    def __init__(self, late_s: float):
        self.late_s, self.calls, self.lock = late_s, 0, threading.Lock()

    def ReportResult(self, request, context):
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            time.sleep(self.late_s)
        return pb.ReportResultResponse()


@pytest.fixture
def slow_coordinator():
    servicer = _SlowFirstAnswer(late_s=1.5)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    control_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None).wait()


def test_a_result_not_answered_in_time_by_a_running_coordinator_is_sent_again(slow_coordinator, tmp_path,
                                                                               monkeypatch, capfd):
    monkeypatch.setattr(agent_job, "REPORT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(agent_job, "RESEND_PAUSE_S", 0.05)
    servicer, address = slow_coordinator
    agent = Agent(address, "token", "n1", work_dir=tmp_path)
    try:
        agent._call("ReportResult", pb.ReportResultRequest(agent_id="x", ok=True))
    finally:
        agent.finished.set()
        agent.probe.close()
        agent.channel.close()
    err = capfd.readouterr().err
    assert "ReportResult not answered (DEADLINE_EXCEEDED): sending it again until it is" in err, err
    assert "ReportResult answered at attempt 2" in err, err
    assert servicer.calls >= 2


def test_a_report_to_a_coordinator_that_is_gone_is_not_sent_again(tmp_path, monkeypatch, capfd):
    """Refused: gone, so the report fails once (the heartbeat loop ends the agent)."""
    import socket
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{spare.getsockname()[1]}"  # closed when the block ends: nothing listens
    agent = Agent(address, "token", "n1", work_dir=tmp_path)
    try:
        started = time.monotonic()
        agent._call("ReportResult", pb.ReportResultRequest(agent_id="x", ok=True))
        took = time.monotonic() - started
    finally:
        agent.finished.set()
        agent.probe.close()
        agent.channel.close()
    err = capfd.readouterr().err
    assert "ReportResult failed (UNAVAILABLE)" in err and "sending it again" not in err, err
    assert took < 10, took
