"""What a link does with a peer that lies or goes quiet, and with a failure on its own side
(runtime/link.py). Found by a hostile review of the one-round-trip protocol; each case failed
before its fix.

Two real processes over gloo where a peer is involved; the raw peers write the wire protocol
with dist.send, as a buggy or hostile peer would.
"""

from __future__ import annotations

import signal
import types

import pytest
import torch
import torch.distributed as dist

from conftest import run_gloo_ranks
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime import host_clock
from hetlaunch.runtime.codecs import NoneCodec, codec_by_id
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.link import Link, LinkStats
from hetlaunch.runtime.link_header import encode_header
from hetlaunch.runtime.stage_move import retarget_links

NONE = NoneCodec()
CPU = torch.device("cpu")


def _truncated_rank(rank: int, out_dir: str) -> None:
    """After 16 floats are agreed, a header of 16 floats comes with 8 bytes: gloo fills the posted
    buffer only that far and cannot say so; the rest must be zeros, not this process's old memory."""
    if rank == 0:
        link = Link(1, NONE, CPU, CPU, tag=2)
        link.send(torch.ones(16))
        link.drain()
        dist.send(encode_header(NONE, (16,), torch.float32), dst=1, tag=2)
        dist.send(torch.tensor([1.5, 2.5]).view(torch.uint8), dst=1, tag=2)
    else:
        link = Link(0, NONE, CPU, CPU, tag=2)
        assert torch.equal(link.recv(), torch.ones(16))
        for _ in range(20):  # freed buffers of non-zero bytes, for the next allocation to reuse
            torch.full((16,), 7.0)
        got = link.recv()
        assert torch.equal(got, torch.tensor([1.5, 2.5] + [0.0] * 14)), got
    dist.barrier()


@pytest.mark.timeout(90)
def test_a_message_shorter_than_its_header_arrives_zero_filled_not_with_stale_memory(tmp_path):
    run_gloo_ranks(_truncated_rank, 2, tmp_path)


def _future_rank(rank: int, out_dir: str) -> None:
    """On an emulated wire the receiver sleeps until a message is due, from the send time in its
    header: a time an hour ahead must not hold it for an hour (the test's timeout would fail it)."""
    if rank == 0:
        dist.send(encode_header(NONE, (2,), torch.float32, notice=True), dst=1, tag=2)  # the layout, then the message
        dist.send(encode_header(NONE, (2,), torch.float32, sent_at=host_clock.now() + 3600), dst=1, tag=2)
        dist.send(torch.ones(2).view(torch.uint8), dst=1, tag=2)
    else:
        link = Link(0, NONE, CPU, CPU, tag=2, emulation=WireEmulation(bandwidth_bytes_per_s=0.0, latency_s=0.01))
        assert torch.equal(link.recv(), torch.ones(2))
    dist.barrier()


@pytest.mark.timeout(60)
def test_a_send_time_in_the_future_does_not_hold_an_emulated_receiver(tmp_path):
    run_gloo_ranks(_future_rank, 2, tmp_path)


class _Interrupted(Exception):
    pass


def _interrupted_rank(rank: int, out_dir: str) -> None:
    """A wait for a message received ahead, cut short in the waiting thread (as Ctrl-C does), leaves
    the receive running on the link's thread: stop_receiving must say so, or the caller tears the
    process group down under it (runtime/stage_command.py)."""
    link = Link(1 - rank, NONE, CPU, CPU, tag=2)
    if rank == 1:
        link.expect(1)

        def interrupt(signum, frame):
            raise _Interrupted

        signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)  # rank 0 sends nothing until the barrier below
        with pytest.raises(_Interrupted):
            link.recv()
        assert link.stop_receiving() is True
    dist.barrier()
    if rank == 0:
        link.send(torch.ones(3))
        link.drain()  # returns once rank 1's thread has taken it
    else:
        link._receiver.submit(lambda: None).result(timeout=30)  # its thread is done with the receive
    dist.barrier()


@pytest.mark.timeout(90)
def test_stop_receiving_sees_a_receive_whose_wait_was_interrupted(tmp_path):
    run_gloo_ranks(_interrupted_rank, 2, tmp_path)


def test_a_tuple_with_an_element_that_cannot_cross_sends_nothing():
    """Element 1 is refused (int16 has no wire code): element 0 must not have left, or the peer holds
    half a message. Nothing is sent at all (there is no process group here: a send would fail)."""
    link = Link(1, NONE, CPU, CPU)
    with pytest.raises(ValueError, match="dtype torch.int16 cannot cross a link"):
        link.send((torch.ones(4), torch.ones(4, dtype=torch.int16)))
    assert link.stats == LinkStats()


def test_a_move_retargets_the_evaluation_links_as_well_as_trainings():
    """Evaluation forwards cross the same boundary (runtime/bubble_fill.py): after a move, its codec
    and size bound are the new boundary's on all four links."""
    links = {name: Link(0, NONE, CPU, CPU, max_message_bytes=1000) for name in ("prev", "next", "prev_eval", "next_eval")}
    executor = types.SimpleNamespace(prev_link=links["prev"], next_link=links["next"],
                                     eval_links=(links["prev_eval"], links["next_eval"]))
    int8 = codec_by_id(pb.CODEC_INT8)
    spec = pb.StageSpec(prev=pb.LinkSpec(backward_codec=int8.wire_id, max_message_bytes=5000),
                        next=pb.LinkSpec(forward_codec=int8.wire_id, max_message_bytes=7000))
    retarget_links(executor, spec)
    assert {name: (type(link.send_codec), link.max_message_bytes) for name, link in links.items()} == {
        "prev": (type(int8), 5000), "prev_eval": (type(int8), 5000),
        "next": (type(int8), 7000), "next_eval": (type(int8), 7000)}

