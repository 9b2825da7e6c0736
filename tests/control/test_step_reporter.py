"""Step reports leave on a thread of their own, in order, and a result waits for them."""

from __future__ import annotations

import threading
import time

from hetlaunch.runtime.step_reporter import MAX_PENDING, StepReporter


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
