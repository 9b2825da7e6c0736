"""The rendezvous store lives on the control plane: bounded operations behind the token, gloo
rendezvousing through it for real, and no other port for `up` to leave open."""

from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest

from conftest import popen_hetlaunch, stop_process, wait_for
from hetlaunch.launcher.coordinator import CoordinatorServer
from hetlaunch.launcher.rendezvous_store import MAX_VALUE_BYTES, RendezvousStore, StoreRefused
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.version import hetlaunch_version, torch_version


def test_the_store_does_what_c10d_asks_and_refuses_what_is_too_big():
    store = RendezvousStore()
    assert store.handle(pb.StoreRequest(op="set", keys=["a"], value=b"1"), 5).ok
    assert store.handle(pb.StoreRequest(op="get", keys=["a"]), 5).value == b"1"
    assert store.handle(pb.StoreRequest(op="add", keys=["n"], amount=3), 5).number == 3
    assert store.handle(pb.StoreRequest(op="add", keys=["n"], amount=-1), 5).number == 2
    assert store.handle(pb.StoreRequest(op="compare_set", keys=["c"], expected=b"", value=b"x"), 5).value == b"x"
    assert store.handle(pb.StoreRequest(op="compare_set", keys=["c"], expected=b"y", value=b"z"), 5).value == b"x"
    assert store.handle(pb.StoreRequest(op="check", keys=["a", "n"]), 5).ok
    assert not store.handle(pb.StoreRequest(op="get", keys=["missing"], timeout_s=0.2), 5).ok  # waited, then no
    later = threading.Timer(0.2, lambda: store.handle(pb.StoreRequest(op="set", keys=["late"], value=b"v"), 5))
    later.start()
    start = time.monotonic()
    assert store.handle(pb.StoreRequest(op="wait", keys=["late"], timeout_s=5), 5).ok
    assert time.monotonic() - start < 2
    with pytest.raises(StoreRefused):
        store.handle(pb.StoreRequest(op="set", keys=["big"], value=b"x" * (MAX_VALUE_BYTES + 1)), 5)
    with pytest.raises(StoreRefused, match="unknown store operation"):
        store.handle(pb.StoreRequest(op="list_keys"), 5)
    assert store.handle(pb.StoreRequest(op="delete", keys=["a"]), 5).ok
    assert store.handle(pb.StoreRequest(op="num_keys"), 5).number == 3


def test_an_add_beyond_a_count_or_onto_text_is_refused_and_keeps_the_value():
    """An add past 2**63 was kept, then failed to reply, and read back as 18446744073709551615; an
    add onto a key holding text raised a bare ValueError (a review)."""
    store = RendezvousStore()
    store.handle(pb.StoreRequest(op="add", keys=["n"], amount=(1 << 63) - 1), 5)
    with pytest.raises(StoreRefused, match="beyond a 64-bit count"):
        store.handle(pb.StoreRequest(op="add", keys=["n"], amount=1), 5)
    assert store.handle(pb.StoreRequest(op="get", keys=["n"]), 5).value == str((1 << 63) - 1).encode()
    store.handle(pb.StoreRequest(op="set", keys=["t"], value=b"text"), 5)
    with pytest.raises(StoreRefused, match="does not hold a number"):
        store.handle(pb.StoreRequest(op="add", keys=["t"], amount=1), 5)
    with pytest.raises(StoreRefused) as full:
        store.handle(pb.StoreRequest(op="set", keys=["big"], value=b"x" * (MAX_VALUE_BYTES + 1)), 5)
    assert not full.value.full  # what was asked is wrong (INVALID_ARGUMENT), not the store full


def test_the_store_rpc_needs_the_token():
    server = CoordinatorServer("127.0.0.1", 0, "right-token", ["a"]).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = control_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.StoreOp(pb.StoreRequest(op="num_keys"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as wrong:
                stub.StoreOp(pb.StoreRequest(op="num_keys"), metadata=(("x-hetlaunch-token", "nope"),), timeout=5)
            assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED
            meta = (("x-hetlaunch-token", "right-token"),)
            # The token alone is not enough: only a registered agent, only in the current generation's keys.
            with pytest.raises(grpc.RpcError) as unregistered:
                stub.StoreOp(pb.StoreRequest(op="get", keys=["gen0/rank_0"], timeout_s=1), metadata=meta, timeout=5)
            assert unregistered.value.code() == grpc.StatusCode.NOT_FOUND
            agent = pb.AgentInfo(node_name="a", hostname="h", agent_version=hetlaunch_version(),
                                 torch_version=torch_version(), pid=1)
            agent_id = stub.Register(pb.RegisterRequest(agent=agent), metadata=meta, timeout=5).agent_id
            generation = server.state.begin_generation()
            for key in ("k", f"gen{generation + 1}/next", f"gen{generation - 1}/old"):
                with pytest.raises(grpc.RpcError) as elsewhere:
                    stub.StoreOp(pb.StoreRequest(op="set", keys=[key], value=b"junk", agent_id=agent_id),
                                 metadata=meta, timeout=5)
                assert elsewhere.value.code() == grpc.StatusCode.PERMISSION_DENIED, key
            ok = stub.StoreOp(pb.StoreRequest(op="set", keys=[f"gen{generation}/k"], value=b"v", agent_id=agent_id),
                              metadata=meta, timeout=5)
            assert ok.ok
            server.state.begin_generation()  # the old generation's keys go with it
            assert server.state.store.handle(pb.StoreRequest(op="num_keys"), 1.0).number == 0
    finally:
        server.stop()


@pytest.mark.timeout(150)
def test_up_listens_on_one_port_only_while_a_job_trains(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("""name: ports
model: {preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}
train: {steps: 300, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}
nodes:
  - {name: a, device: cpu, threads: 1}
  - {name: b, device: cpu, threads: 1}
""")
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(yaml), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and
                 len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 3, 90, "3 steps", proc=up)
        listening = {c.laddr.port for c in psutil.Process(up.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        contact = (run_dir / "coordinator.json").read_text()
        assert len(listening) == 1 and f":{listening.pop()}\"" in contact, (listening, contact)
    finally:
        stop_process(up)


def test_a_blocked_get_ends_when_the_store_closes_or_the_caller_leaves():
    store = RendezvousStore()
    threading.Timer(0.3, store.close).start()
    start = time.monotonic()
    assert not store.handle(pb.StoreRequest(op="get", keys=["never"], timeout_s=60), 60).ok
    assert time.monotonic() - start < 5
    other = RendezvousStore()
    gone = time.monotonic() + 0.3
    start = time.monotonic()
    assert not other.handle(pb.StoreRequest(op="wait", keys=["never"], timeout_s=60), 60,
                            wanted=lambda: time.monotonic() < gone).ok
    assert time.monotonic() - start < 5


def test_the_store_holds_64_mib_at_most_and_frees_what_is_deleted():
    store = RendezvousStore()
    value = b"x" * MAX_VALUE_BYTES
    for i in range(64):
        store.handle(pb.StoreRequest(op="set", keys=[f"k{i}"], value=value), 1.0)
    with pytest.raises(StoreRefused, match="over its 64 MiB"):
        store.handle(pb.StoreRequest(op="set", keys=["one-more"], value=b"y"), 1.0)
    store.handle(pb.StoreRequest(op="set", keys=["k0"], value=b"small"), 1.0)  # replacing frees the old value
    store.handle(pb.StoreRequest(op="delete", keys=["k1"]), 1.0)
    store.handle(pb.StoreRequest(op="set", keys=["one-more"], value=value), 1.0)


@pytest.mark.timeout(30)
def test_blocking_store_calls_are_capped_and_the_others_still_served():
    store = RendezvousStore(max_blocked=3)
    waiting = [threading.Thread(target=store.handle, args=(pb.StoreRequest(op="wait", keys=["never"], timeout_s=5),
                                                           5.0)) for _ in range(3)]
    for thread in waiting:
        thread.start()
    try:
        wait_for(lambda: store.blocked_calls() == {"": 3}, 20, "the three calls to block")
        with pytest.raises(StoreRefused, match="3 store calls are waiting already"):
            store.handle(pb.StoreRequest(op="get", keys=["never"], timeout_s=5), 5.0)
        assert store.handle(pb.StoreRequest(op="set", keys=["k"], value=b"v"), 1.0).ok  # not blocking: served
        assert store.handle(pb.StoreRequest(op="get", keys=["k"], timeout_s=0), 1.0).value == b"v"
    finally:
        store.close()
        for thread in waiting:
            thread.join(timeout=10)
    assert store.handle(pb.StoreRequest(op="check", keys=["k"]), 1.0).ok


@pytest.mark.timeout(30)
def test_one_agent_cannot_take_every_waiting_place():
    store = RendezvousStore(max_blocked=6, max_blocked_per_caller=2)

    def wait(caller: str) -> threading.Thread:
        thread = threading.Thread(target=store.handle, args=(pb.StoreRequest(op="wait", keys=["never"], timeout_s=20),
                                                             20.0), kwargs={"caller": caller})
        thread.start()
        return thread
    waiting = [wait("hostile"), wait("hostile")]
    try:
        wait_for(lambda: store.blocked_calls() == {"hostile": 2}, 20, "the hostile agent's calls to block")
        with pytest.raises(StoreRefused, match="2 store calls of this agent are waiting already"):
            store.handle(pb.StoreRequest(op="wait", keys=["never"], timeout_s=20), 20.0, caller="hostile")
        waiting += [wait("good")]  # another agent still gets a place
        wait_for(lambda: store.blocked_calls() == {"hostile": 2, "good": 1}, 20, "the good agent's call to block")
        store.handle(pb.StoreRequest(op="set", keys=["never"], value=b"v"), 1.0)
        wait_for(lambda: store.blocked_calls() == {}, 20, "every call to end once the key is set")
        assert store.handle(pb.StoreRequest(op="wait", keys=["never"], timeout_s=1), 1.0, caller="hostile").ok
    finally:
        store.close()
        for thread in waiting:
            thread.join(timeout=10)
