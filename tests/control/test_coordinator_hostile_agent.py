"""What an agent holding the job's token cannot do to the coordinator (a hostile review): forge or
overwrite a checkpoint through part uploads, take every server thread with transfers that never
move so good agents' heartbeats go unanswered, or pile up command streams. Real gRPC on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.checkpoint_manifest import MANIFEST_NAME, checkpoint_dir
from coordinator_client import RPC_TIMEOUT, auth, channel, register, server, stub  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)


def _upload(stub, agent_id: str, file: str, step: int = 5, generation: int = 0, data: bytes = b"bytes"):
    return stub.UploadPart(iter([pb.PartChunk(agent_id=agent_id, generation=generation, step=step, file=file,
                                              data=data)]), metadata=auth(), timeout=RPC_TIMEOUT)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_an_upload_never_writes_a_manifest_or_into_a_committed_checkpoint(server, stub, tmp_path):
    server.state.checkpoint_root = tmp_path
    agent = register(stub, "a").agent_id
    err = _refused(lambda: _upload(stub, agent, MANIFEST_NAME, step=99999999))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "written by the coordinator" in err.details()
    committed = checkpoint_dir(tmp_path, 20)
    committed.mkdir()
    (committed / MANIFEST_NAME).write_text("{}")
    (committed / "layers-0-2.safetensors").write_bytes(b"the run's")
    err = _refused(lambda: _upload(stub, agent, "layers-0-2.safetensors", step=20))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "is committed" in err.details()
    assert (committed / "layers-0-2.safetensors").read_bytes() == b"the run's"
    err = _refused(lambda: _upload(stub, agent, "layers-0-2.safetensors", generation=7))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "generation 7" in err.details()
    assert not checkpoint_dir(tmp_path, 5).exists()
    reply = _upload(stub, agent, "layers-0-2.safetensors")  # a part of this generation, not yet committed
    assert reply.bytes == 5 and (checkpoint_dir(tmp_path, 5) / "layers-0-2.safetensors").read_bytes() == b"bytes"


def test_transfers_that_never_move_cannot_take_the_threads_heartbeats_need(server, stub, tmp_path):
    server.state.checkpoint_root = tmp_path
    hostile, good = register(stub, "a").agent_id, register(stub, "b").agent_id
    release = threading.Event()

    def silent():  # an upload that never sends its first chunk
        release.wait(RPC_TIMEOUT * 3)
        return
        yield

    held = [stub.UploadPart.future(silent(), metadata=auth(), timeout=RPC_TIMEOUT * 4) for _ in range(40)]
    try:
        deadline, exhausted = time.monotonic() + RPC_TIMEOUT * 2, None
        while exhausted is None and time.monotonic() < deadline:
            try:  # refused at once once the transfers allowed are all held, not queued behind them
                _upload(stub, hostile, "layers-0-2.safetensors")
            except grpc.RpcError as err:
                exhausted = err
        assert exhausted is not None and exhausted.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exhausted
        for _ in range(5):
            stub.Heartbeat(pb.HeartbeatRequest(agent_id=good), metadata=auth(), timeout=RPC_TIMEOUT)
    finally:
        release.set()
        for call in held:
            try:
                call.result()
            except grpc.RpcError:
                pass  # refused: too many transfers, or an empty upload


def test_a_second_command_stream_of_an_agent_replaces_the_first(server, stub):
    agent = register(stub, "a").agent_id
    first = stub.WatchCommands(pb.WatchCommandsRequest(agent_id=agent), metadata=auth(), timeout=RPC_TIMEOUT * 2)
    server.state.send("a", pb.Command(run_stage=pb.RunStage(stage=pb.StageSpec(stage_index=0))))
    assert next(first).WhichOneof("kind") == "run_stage"  # the first stream is being served
    second = stub.WatchCommands(pb.WatchCommandsRequest(agent_id=agent), metadata=auth(), timeout=RPC_TIMEOUT * 2)
    assert list(first) == []  # the older stream ends, without a command, once the newer one is there
    for index in (1, 2):
        server.state.send("a", pb.Command(run_stage=pb.RunStage(stage=pb.StageSpec(stage_index=index))))
    server.state.send("a", pb.Command(shutdown=pb.Shutdown(reason="done")))
    received = list(second)  # every later command, in order, on the newer stream
    assert [c.WhichOneof("kind") for c in received] == ["run_stage", "run_stage", "shutdown"]
    assert [c.run_stage.stage.stage_index for c in received[:2]] == [1, 2]


def test_an_upload_that_lands_after_the_commit_does_not_replace_the_committed_part(server, stub, tmp_path):
    """The committed check ran only when an upload began: one begun before the manifest was written
    replaced the committed part when it ended (a review). Checked again as it lands."""
    server.state.checkpoint_root = tmp_path
    agent = register(stub, "a").agent_id
    step = checkpoint_dir(tmp_path, 5)

    def slow():
        yield pb.PartChunk(agent_id=agent, generation=0, step=5, file="layers-0-2.safetensors", data=b"forged")
        deadline = time.monotonic() + RPC_TIMEOUT  # until the server writes the upload (past its first check)
        while not list(step.glob(".*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.01)
        # the run's part and manifest, committed while the upload is under way
        (step / "layers-0-2.safetensors").write_bytes(b"the run's")
        (step / MANIFEST_NAME).write_text("{}")
        yield pb.PartChunk(data=b" bytes")

    err = _refused(lambda: stub.UploadPart(slow(), metadata=auth(), timeout=RPC_TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "committed meanwhile" in err.details()
    assert (step / "layers-0-2.safetensors").read_bytes() == b"the run's"
    assert sorted(p.name for p in step.iterdir()) == sorted([MANIFEST_NAME, "layers-0-2.safetensors"])  # no temp left


def test_a_replaced_command_stream_takes_no_command():
    """A stream replaced while it waited took the next command and handed it back to the queue's
    head, after the newer stream could have taken a later one: out of order (a review)."""
    import queue

    from hetlaunch.launcher.coordinator import _next_command

    commands: queue.Queue = queue.Queue()
    commands.put("first")
    assert _next_command(commands, lambda: False, 0.01) is None  # replaced: left where it is
    assert _next_command(commands, lambda: True, 0.01) == "first"
    assert _next_command(commands, lambda: True, 0.01) is None  # nothing left: waits, then None


def test_step_reports_are_bounded_per_call_and_in_the_queue(server, stub, monkeypatch):
    """A report of 400,000 steps, and reports queued while nothing took them, grew the coordinator by
    634 MB in 6 s (a review): a call holds at most what an agent's relay coalesces, the queue a bound."""
    from hetlaunch.launcher import coordinator_state
    from hetlaunch.runtime.step_reporter import MAX_PENDING

    agent = register(stub, "a").agent_id
    many = pb.ReportStepRequest(agent_id=agent, generation=0, metrics=pb.StepMetrics(step=1),
                                more_metrics=[pb.StepMetrics(step=s) for s in range(2, MAX_PENDING + 2)])
    err = _refused(lambda: stub.ReportStep(many, metadata=auth(), timeout=RPC_TIMEOUT))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and f"at most {MAX_PENDING}" in err.details()
    del many.more_metrics[-1]  # what a relay sends at most
    stub.ReportStep(many, metadata=auth(), timeout=RPC_TIMEOUT)
    monkeypatch.setattr(coordinator_state, "MAX_QUEUED_STEPS", 5)
    state = coordinator_state.CoordinatorState(["a"])
    for step in range(8):
        state.report_step("a", 0, pb.StepMetrics(step=step))
    assert state.dropped_reports == 3 and state._steps.qsize() == 5


def test_one_agents_store_waits_leave_places_for_the_others(server, stub):
    from hetlaunch.launcher.rendezvous_store import MAX_BLOCKED_PER_CALLER

    hostile, good = register(stub, "a").agent_id, register(stub, "b").agent_id
    key = f"gen{server.state.generation}/never"

    def wait(agent: str):
        return stub.StoreOp.future(pb.StoreRequest(op="wait", keys=[key], timeout_s=20, agent_id=agent),
                                   metadata=auth(), timeout=30)
    held = [wait(hostile) for _ in range(MAX_BLOCKED_PER_CALLER)]
    try:
        deadline = time.monotonic() + 20
        while server.state.store.blocked_calls().get(hostile, 0) < MAX_BLOCKED_PER_CALLER:
            assert time.monotonic() < deadline, server.state.store.blocked_calls()
            time.sleep(0.05)
        err = _refused(lambda: stub.StoreOp(pb.StoreRequest(op="wait", keys=[key], timeout_s=20, agent_id=hostile),
                                            metadata=auth(), timeout=RPC_TIMEOUT))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "of this agent" in err.details()
        held.append(wait(good))  # the other agent's rendezvous still waits, and is answered
        while server.state.store.blocked_calls().get(good, 0) < 1:
            assert time.monotonic() < deadline, server.state.store.blocked_calls()
            time.sleep(0.05)
        stub.StoreOp(pb.StoreRequest(op="set", keys=[key], value=b"v", agent_id=good), metadata=auth(), timeout=RPC_TIMEOUT)
        assert all(call.result(timeout=RPC_TIMEOUT).ok for call in held)
    finally:
        server.state.store.close()
        for call in held:
            call.cancel()
