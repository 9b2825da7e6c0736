"""A sealed stage link between two real gloo ranks (data_plane.encrypt): tensors arrive exactly as
sent, and a second sealer on the channel, a flipped byte, a replay, a foreign key, a truncated or an
oversized message is refused
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
    legit = link.sealing[0]
    thief = Sealer(SECRET, FORWARD)  # a second sealer on the channel: refused from its message 0 on
    _send_raw(*thief.seal(_raw(torch.ones(2))))
    envelope, sealed = legit.seal(_raw(torch.ones(2)))
    _send_raw(envelope, sealed)
    _send_raw(envelope, sealed)  # replayed
    envelope, sealed = legit.seal(_raw(torch.ones(2)))
    flipped = bytearray(sealed)
    flipped[3] ^= 1
    _send_raw(envelope, bytes(flipped))
    forger = Sealer(bytes(32), FORWARD)  # a foreign key, at the place the stream is at
    forger._instance, forger._sequence = legit._instance, legit._sequence - 1
    envelope, sealed = forger.seal(_raw(torch.ones(2)))
    _send_raw(envelope, sealed)
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
    outcomes = []  # per message: what it carried, or the refusal's line
    for _ in range(6):
        try:
            outcomes.append(link.recv().tolist())
        except SealingError as error:
            outcomes.append(str(error))
    dist.barrier()
    Path(out_dir, "receiver.json").write_text(json.dumps(
        {"exact": exact, "int8_error": int8_error, "outcomes": outcomes}))


def _rank(rank: int, out_dir: str) -> None:
    (_sender if rank == 0 else _receiver)(out_dir)


@pytest.mark.timeout(90)
def test_a_sealed_link_delivers_exactly_and_refuses_what_was_tampered_with(tmp_path):
    run_gloo_ranks(_rank, 2, tmp_path, timeout_s=60)
    result = json.loads((tmp_path / "receiver.json").read_text())
    assert result["exact"], "tensors, tuples and bf16 arrive bit for bit"
    assert 0 < result["int8_error"] < 0.1  # a lossy codec still applies, under the seal
    second_sealer, delivered, replay, flipped, foreign, huge = result["outcomes"]
    assert delivered == [1.0, 1.0]
    assert "replayed, reordered or dropped" in second_sealer and "replayed, reordered or dropped" in replay
    assert "failed authentication" in flipped and "failed authentication" in foreign
    assert "at most" in huge
    for line in (second_sealer, replay, flipped, foreign, huge):
        assert "link rank 0 -> rank 1, generation 7" in line and "\n" not in line
