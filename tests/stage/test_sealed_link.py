"""A sealed stage link between two real gloo ranks (data_plane.encrypt): tensors arrive exactly as
sent, and a flipped byte, a replay, a foreign key, a truncated or an oversized message is refused
with one line naming the link, before the stage can train on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import run_gloo_ranks
from hetlaunch.runtime.codecs import codec_by_name
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.link_header import encode_header
from hetlaunch.runtime.sealed_exchange import tensor_bytes
from hetlaunch.runtime.sealing import Channel, Opener, Sealer, SealingError

SECRET = bytes(range(32))
FORWARD = Channel(generation=7, sender=0, receiver=1, stream="link")


def _messages():
    torch.manual_seed(0)
    return [torch.randn(4, 8), (torch.randn(2, 3), torch.arange(6).reshape(2, 3), torch.tensor([True, False])),
            torch.randn(5, 16).to(torch.bfloat16), torch.randn(3, 64)]


def _raw(tensor: torch.Tensor, codec: str = "none") -> bytes:
    c = codec_by_name(codec)
    return tensor_bytes([encode_header(c, tuple(tensor.shape), tensor.dtype), *c.encode(tensor)])


def _send_raw(envelope: bytes, sealed: bytes | None) -> None:
    dist.send(torch.frombuffer(bytearray(envelope), dtype=torch.uint8), dst=1)
    if sealed is not None:
        dist.send(torch.frombuffer(bytearray(sealed), dtype=torch.uint8), dst=1)


def _sender(out_dir: str) -> None:
    link = Link(1, codec_by_name("none"), torch.device("cpu"), torch.device("cpu"),
                sealing=(Sealer(SECRET, FORWARD), Opener(SECRET, Channel(7, 1, 0, "link"))))
    for message in _messages()[:3]:
        link.send(message)
    link.send_codec = codec_by_name("int8")
    link.send(_messages()[3])
    link.drain()
    # Position 0 changed length three times after its first message (each a sealed notice first);
    # the tuple's positions 1 and 2 were each read envelope first, once.
    assert link.stats.notices == 3, link.stats
    # The hostile cases: bytes written to the wire by hand.
    thief = Sealer(SECRET, FORWARD)  # a second instance: its message 0 is accepted once
    envelope, sealed = thief.seal(_raw(torch.ones(2)))
    _send_raw(envelope, sealed)
    _send_raw(envelope, sealed)  # replayed
    envelope, sealed = thief.seal(_raw(torch.ones(2)))
    flipped = bytearray(sealed)
    flipped[3] ^= 1
    _send_raw(envelope, bytes(flipped))
    envelope, sealed = Sealer(bytes(32), FORWARD).seal(_raw(torch.ones(2)))  # a foreign key, message 0
    _send_raw(envelope, sealed)
    envelope, sealed = thief.seal(_raw(torch.ones(2)))
    huge = bytearray(envelope)
    huge[-8:] = (2**40).to_bytes(8, "little")  # announces a terabyte: refused before allocating
    _send_raw(bytes(huge), None)
    dist.barrier()


def _receiver(out_dir: str) -> None:
    link = Link(0, codec_by_name("none"), torch.device("cpu"), torch.device("cpu"), max_message_bytes=2**20,
                sealing=(Sealer(SECRET, Channel(7, 1, 0, "link")), Opener(SECRET, FORWARD)))
    got = [link.recv() for _ in range(4)]
    want = _messages()
    exact = all(torch.equal(a, b) for a, b in zip(got[1], want[1])) and torch.equal(got[0], want[0]) \
        and torch.equal(got[2], want[2]) and got[2].dtype == torch.bfloat16
    int8_error = (got[3] - want[3]).abs().max().item()
    first = link.recv()  # the second instance's message 0
    refusals = []
    for _ in range(4):
        try:
            link.recv()
            refusals.append(None)
        except SealingError as error:
            refusals.append(str(error))
    dist.barrier()
    Path(out_dir, "receiver.json").write_text(json.dumps(
        {"exact": exact, "int8_error": int8_error, "first": first.tolist(), "refusals": refusals}))


def _rank(rank: int, out_dir: str) -> None:
    (_sender if rank == 0 else _receiver)(out_dir)


@pytest.mark.timeout(90)
def test_a_sealed_link_delivers_exactly_and_refuses_what_was_tampered_with(tmp_path):
    run_gloo_ranks(_rank, 2, tmp_path, timeout_s=60)
    result = json.loads((tmp_path / "receiver.json").read_text())
    assert result["exact"], "tensors, tuples and bf16 arrive bit for bit"
    assert 0 < result["int8_error"] < 0.1  # a lossy codec still applies, under the seal
    assert result["first"] == [1.0, 1.0]
    replay, flipped, foreign, huge = result["refusals"]
    assert "replayed, reordered or dropped" in replay
    assert "failed authentication" in flipped and "failed authentication" in foreign
    assert "at most" in huge
    for line in result["refusals"]:
        assert "link rank 0 -> rank 1, generation 7" in line and "\n" not in line
