"""Step reports leave on a thread of their own, in order, and a result waits for them."""

from __future__ import annotations

import threading
import time

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.step_reporter import MAX_PENDING, StepReporter, coalesce_step_reports


def test_reports_go_out_in_order_without_holding_up_the_caller_and_flush_waits():
    sent, gate = [], threading.Event()

    def slow_send(request):
        gate.wait(5)  # a coordinator that does not answer for a while
        sent.append(request)

    reporter = StepReporter(slow_send)
    start = time.monotonic()
    for step in range(10):
        reporter.report(step)
    assert time.monotonic() - start < 0.5, "report() waited for the RPC"
    assert not reporter.flush(timeout_s=0.2)  # still stuck behind the slow send
    gate.set()
    assert reporter.flush(timeout_s=5)
    assert sent == list(range(10))
    reporter.close()


def test_a_full_queue_pushes_back_instead_of_dropping():
    sent, gate = [], threading.Event()
    reporter = StepReporter(lambda request: (gate.wait(5), sent.append(request)))
    filler = threading.Thread(target=lambda: [reporter.report(i) for i in range(MAX_PENDING + 5)])
    filler.start()
    filler.join(0.5)
    assert filler.is_alive(), "the queue should be full and report() waiting"
    gate.set()
    filler.join(5)
    assert reporter.flush(5) and sent == list(range(MAX_PENDING + 5))
    reporter.close()


def test_a_failing_send_does_not_stop_the_sender():
    sent = []

    def flaky(request):
        if request == 1:
            raise RuntimeError("boom")
        sent.append(request)

    reporter = StepReporter(flaky)
    for step in range(3):
        reporter.report(step)
    assert reporter.flush(5)
    assert sent == [0, 2]
    reporter.close()


def _request(step: int, generation: int = 1, agent: str = "a") -> pb.ReportStepRequest:
    return pb.ReportStepRequest(agent_id=agent, generation=generation, metrics=pb.StepMetrics(step=step))


def _steps(request: pb.ReportStepRequest) -> list[int]:
    return [m.step for m in (request.metrics, *request.more_metrics)]


def test_reports_of_one_interval_go_out_as_one_rpc_in_order_and_flush_does_not_wait_for_the_interval():
    sent, first_out = [], threading.Event()

    def send(request):
        sent.append(request)
        first_out.set()

    # an interval longer than any machine has been up: a reporter that counts its first interval from
    # monotonic time 0 (i.e. from boot) holds the first report back, and fails here on any machine
    reporter = StepReporter(send, coalesce_step_reports, interval_s=1e9)
    reporter.report(_request(0))
    assert first_out.wait(5)  # nothing sent before: the first report leaves at once
    for step in range(1, 40):
        reporter.report(_request(step))
    time.sleep(0.2)
    assert len(sent) == 1  # the others wait for the interval...
    start = time.monotonic()
    assert reporter.flush(timeout_s=5)  # ...unless flushed
    assert time.monotonic() - start < 5
    assert [_steps(r) for r in sent] == [[0], list(range(1, 40))]
    reporter.close()


def test_coalescing_keeps_generations_and_agents_apart_and_nothing_is_lost():
    requests = [_request(0), _request(1), _request(2, generation=2), _request(3, generation=2), _request(4, agent="b")]
    merged = coalesce_step_reports(requests)
    assert [(r.agent_id, r.generation, _steps(r)) for r in merged] == \
        [("a", 1, [0, 1]), ("a", 2, [2, 3]), ("b", 1, [4])]
    assert _steps(requests[0]) == [0]  # the requests passed in are left as they were
