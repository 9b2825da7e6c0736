"""The data-plane link: header wire format, the codec registry, and real gloo send/recv between two processes."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from conftest import run_gloo_ranks
from hetlaunch.protos import control_pb2
from hetlaunch.runtime.codecs import CODECS, NoneCodec, codec_by_id
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.link_header import DTYPE_CODES, HEADER_LEN, MAX_DIMS, decode_header, encode_header

NONE = NoneCodec()


# ---------------------------------------------------------------- header


def _shape(ndim: int) -> tuple[int, ...]:
    # Small, zero and larger-than-int32 dims: the header carries int64.
    pool = [3, 1, 0, 7, 2**33 + 5, 2, 5, 11]
    return tuple(pool[:ndim])


@pytest.mark.parametrize("dtype", list(DTYPE_CODES), ids=str)
@pytest.mark.parametrize("ndim", range(MAX_DIMS + 1))
def test_header_round_trip(dtype, ndim):
    shape = _shape(ndim)
    header = encode_header(NONE, shape, dtype, sent_at=1_700_000_000.25)
    assert header.dtype == torch.int64 and header.shape == (HEADER_LEN,)
    head = decode_header(header)
    assert head.codec.wire_id == NONE.wire_id
    assert head.shape == shape
    assert head.dtype == dtype
    assert head.sent_at == pytest.approx(1_700_000_000.25, abs=1e-6)


def test_header_refuses_more_than_max_dims():
    with pytest.raises(ValueError, match="dims"):
        encode_header(NONE, (1,) * (MAX_DIMS + 1), torch.float32)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.uint16], ids=str)
def test_header_refuses_unknown_dtype(dtype):
    assert dtype not in DTYPE_CODES
    with pytest.raises(ValueError, match="dtype"):
        encode_header(NONE, (2, 3), dtype)


def test_decode_refuses_corrupt_headers():
    good = encode_header(NONE, (2, 3), torch.float32)
    bad_version = good.clone()
    bad_version[0] = 99
    with pytest.raises(ValueError, match="version"):
        decode_header(bad_version)
    bad_dtype = good.clone()
    bad_dtype[2] = 999
    with pytest.raises(ValueError, match="corrupt"):
        decode_header(bad_dtype)
    bad_ndim = good.clone()
    bad_ndim[HEADER_LEN - MAX_DIMS - 1] = MAX_DIMS + 1  # ndim comes right before the dims
    with pytest.raises(ValueError, match="corrupt"):
        decode_header(bad_ndim)
    bad_codec = good.clone()
    bad_codec[1] = 12345
    with pytest.raises(ValueError, match="codec"):
        decode_header(bad_codec)
    # Tuple fields: a count past the limit, a position outside the count, a flag that is not 0/1.
    for position, count, complex_ in ((0, 65, 0), (3, 3, 0), (1, 0, 0), (-1, 2, 0), (0, 2, 7)):
        bad = encode_header(NONE, (2, 3), torch.float32)
        bad[4], bad[5], bad[6] = position, count, complex_
        with pytest.raises(ValueError, match="corrupt"):
            decode_header(bad)
    element = decode_header(encode_header(NONE, (2, 3), torch.float32, position=2, count=3, complex_=True))
    assert (element.position, element.count, element.complex_) == (2, 3, True)


# ---------------------------------------------------------------- codecs


def test_every_wire_codec_has_a_codec():
    wire_values = [v for v in control_pb2.Codec.values() if v != control_pb2.CODEC_UNSPECIFIED]
    assert wire_values
    for value in wire_values:
        assert value in CODECS, f"no codec for {control_pb2.Codec.Name(value)}"
        assert CODECS[value].wire_id == value
        assert codec_by_id(value) is CODECS[value]
    assert control_pb2.CODEC_UNSPECIFIED not in CODECS
    assert set(CODECS) <= set(control_pb2.Codec.values())


@pytest.mark.parametrize("wire_id", sorted(CODECS), ids=lambda v: control_pb2.Codec.Name(v))
@pytest.mark.parametrize("shape", [(4, 16, 32), (3, 5), (7,)], ids=str)
def test_codec_round_trip(wire_id, shape):
    codec = CODECS[wire_id]
    gen = torch.Generator().manual_seed(1)
    tensor = torch.randn(shape, generator=gen) * 3
    payloads = codec.encode(tensor)
    specs = codec.payload_specs(shape, tensor.dtype)
    assert [(tuple(p.shape), p.dtype) for p in payloads] == [(tuple(s), d) for s, d in specs]
    assert codec.wire_bytes(shape, tensor.dtype) == sum(p.numel() * p.element_size() for p in payloads)
    decoded = codec.decode([p.clone() for p in payloads], shape, tensor.dtype)
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    if codec.name == "none":
        assert torch.equal(decoded, tensor)
    else:  # lossy codecs: close (relative L2 error; per-codec bounds belong to the codec tests)
        assert torch.linalg.vector_norm(decoded - tensor) <= 0.25 * torch.linalg.vector_norm(tensor)


# ---------------------------------------------------------------- two real processes over gloo


def _tensors(seed: int) -> list[torch.Tensor]:
    """Deterministic tensors of several shapes and every dtype a link carries; both ranks rebuild them."""
    gen = torch.Generator().manual_seed(seed)
    floats = torch.randn(2, 3, 4, generator=gen)
    floats[0, 0, 0] = float("nan")
    floats[0, 0, 1] = float("-inf")
    floats[0, 0, 2] = -0.0
    return [
        floats,
        torch.randn(4, 16, 32, generator=gen),
        torch.tensor(3.25),  # 0-dim
        torch.randn(5, generator=gen).half(),
        torch.randn(2, 7, generator=gen).bfloat16(),
        torch.randn(3, 3, generator=gen, dtype=torch.float64),
        torch.randint(-2**62, 2**62, (6,), generator=gen, dtype=torch.int64),
        torch.randint(-2**31, 2**31 - 1, (2, 2, 2), generator=gen, dtype=torch.int32),
        torch.randint(0, 256, (9,), generator=gen, dtype=torch.uint8),
        torch.randint(-128, 128, (1, 9), generator=gen, dtype=torch.int8),
        torch.randint(0, 2, (4, 1), generator=gen).bool(),
        torch.randn(1, 1, 1, 1, 1, 1, 1, 2, generator=gen),  # MAX_DIMS
    ]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _link_rank(rank: int, out_dir: str) -> None:
    cpu = torch.device("cpu")
    link = Link(1 - rank, NONE, cpu, cpu)
    forward, backward = _tensors(seed=10), _tensors(seed=20)
    # rank 0 -> rank 1, then rank 1 -> rank 0: each side sends everything, then drains.
    for sender, batch in ((0, forward), (1, backward)):
        if rank == sender:
            for t in batch:
                link.send(t)
            link.drain()
            assert link.stats.messages == len(batch)
            assert link.stats.raw_bytes == sum(t.numel() * t.element_size() for t in batch)
            assert link.stats.wire_bytes == link.stats.raw_bytes  # codec none
            link.stats.messages = link.stats.raw_bytes = link.stats.wire_bytes = 0
        else:
            for i, want in enumerate(batch):
                got = link.recv()
                assert _bits_equal(got, want), f"tensor {i} from rank {sender}: {got} != {want}"
    dist.barrier()


@pytest.mark.timeout(90)
def test_link_send_recv_bit_exact_both_directions(tmp_path):
    run_gloo_ranks(_link_rank, 2, tmp_path)


def _ahead_rank(rank: int, out_dir: str) -> None:
    """Rank 1 posts its receives ahead (`expect`) for the first half, on the link's thread, and
    takes the rest inline; a tuple message among them. Everything arrives bit for bit, in order."""
    cpu = torch.device("cpu")
    link = Link(1 - rank, NONE, cpu, cpu, tag=3)
    batch = _tensors(seed=30)
    messages = batch[:4] + [tuple(batch[4:7])] + batch[7:]
    if rank == 0:
        for m in messages:
            link.send(m)
        link.drain()
    else:
        link.expect(5)  # the first five, the tuple among them, received while this rank does nothing else
        for i, want in enumerate(messages):
            got = link.recv()
            pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
            assert all(_bits_equal(g, w) for g, w in pairs), f"message {i}"
        assert not link.stop_receiving()  # nothing left posted
    dist.barrier()


@pytest.mark.timeout(90)
def test_receives_posted_ahead_arrive_bit_exact_and_in_order(tmp_path):
    run_gloo_ranks(_ahead_rank, 2, tmp_path)


def test_a_header_over_the_links_bound_is_refused_before_anything_is_allocated():
    from hetlaunch.runtime.link_header import HARD_MAX_MESSAGE_BYTES, check_message_size

    head = decode_header(encode_header(NONE, (1000, 1000), torch.float32))
    check_message_size(head, 4_000_000, peer_rank=1)  # exactly the bound
    with pytest.raises(ValueError, match=r"rank 1 announced a 4,000,000-byte tensor \[1000, 1000\], over the "
                                         r"3,999,999 bytes"):
        check_message_size(head, 3_999_999, peer_rank=1)
    huge = decode_header(encode_header(NONE, (2**40, 2**20), torch.float32))  # what a hostile peer might say
    with pytest.raises(ValueError, match="over the"):
        check_message_size(huge, HARD_MAX_MESSAGE_BYTES, peer_rank=0)
    negative = encode_header(NONE, (2, 3), torch.float32)
    negative[HEADER_LEN - MAX_DIMS] = -5
    with pytest.raises(ValueError, match="corrupt"):
        decode_header(negative)


def _stepped_clock_rank(rank: int, out_dir: str) -> None:
    """Rank 0 sends 10 messages; half-way its wall clock steps +0.5 s (what NTP does to a host).
    Rank 1 measures each message's transit as the straggler watch does."""
    import time

    cpu = torch.device("cpu")
    link = Link(1 - rank, NONE, cpu, cpu)
    real_time = time.time
    transits = []
    for i in range(10):
        if rank == 0 and i == 5:
            time.time = lambda: real_time() + 0.5  # the system clock stepped: every reader of it sees it
        if rank == 0:
            link.send(torch.ones(64))
            link.drain()
        else:
            link.least_transit = None
            link.recv()
            transits.append(link.least_transit[0])
        dist.barrier()
    if rank == 1:
        assert max(map(abs, transits)) < 0.25, transits  # never the half second the clock moved


@pytest.mark.timeout(90)
def test_a_step_of_the_senders_wall_clock_does_not_change_a_transit(tmp_path):
    run_gloo_ranks(_stepped_clock_rank, 2, tmp_path)


def test_a_message_due_between_two_readings_of_the_clock_is_taken_not_refused(monkeypatch):
    """recv sleeps until an emulated message is due. It once read the clock twice, to compare and
    then to sleep: when the due time passed in between (a loaded machine), it slept a negative
    length and the stage died ("sleep length must be non-negative", a full-suite run)."""
    from concurrent.futures import Future

    from hetlaunch.runtime import host_clock, link as link_module

    readings = iter([100.0, 100.002, 100.003, 100.004])  # due at 100.001: ahead, then behind
    monkeypatch.setattr(host_clock, "now", lambda: next(readings))
    link = Link(1, NoneCodec(), torch.device("cpu"), torch.device("cpu"))
    arrived = Future()
    message = torch.arange(3.0)
    arrived.set_result(link_module._Arrived(message=message, due=100.001, parts=[(99.9, 100.0, 12)]))
    link._coming.append(arrived)
    assert torch.equal(link.recv(), message)
    assert link.least_transit == (pytest.approx(0.101), 12)  # delivered when due, not when read
