"""A link's receiver posts a message's header and payloads together, sized as the last message at
that tuple position; the sender announces a new layout first (runtime/link.py's docstring).

Two real processes over gloo. The raw peers below speak the wire protocol with dist.isend, as a
buggy or hostile peer would, to hold what the receiver refuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import run_gloo_ranks
from hetlaunch.runtime.codecs import NoneCodec
from hetlaunch.runtime.link import Link
from hetlaunch.runtime.link_header import encode_header
from hetlaunch.runtime.sealed_exchange import tensor_bytes
from hetlaunch.runtime.sealing import Channel, Opener, Sealer, SealingError

NONE = NoneCodec()
CPU = torch.device("cpu")


def _messages() -> list:
    gen = torch.Generator().manual_seed(5)
    hidden = lambda rows: torch.randn(rows, 16, generator=gen)  # noqa: E731
    mask = torch.randint(0, 2, (4,), generator=gen).bool()
    return ([hidden(4) for _ in range(5)]          # one layout: a notice before the first only
            + [(hidden(4), mask), (hidden(4), mask)]  # position 0 as before; position 1 new: one notice
            + [hidden(8), hidden(4), torch.tensor(2.5)])  # each a change at position 0: three notices


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _layout_rank(rank: int, out_dir: str) -> None:
    link = Link(1 - rank, NONE, CPU, CPU, tag=2)
    messages = _messages()
    if rank == 0:
        for message in messages:
            link.send(message)
        link.drain()
        assert link.stats.notices == 5, link.stats
        assert link.stats.messages == len(messages) + 2  # tuple elements count one each
    else:
        link.expect(3)  # some posted ahead, on the link's thread, the rest inline
        for i, want in enumerate(messages):
            got = link.recv()
            pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
            assert all(_bits_equal(g, w) for g, w in pairs), f"message {i}"
    dist.barrier()


@pytest.mark.timeout(90)
def test_only_a_change_of_layout_costs_a_notice_and_every_message_arrives_bit_exact(tmp_path):
    run_gloo_ranks(_layout_rank, 2, tmp_path)


def _raw_peer_sends(case: str) -> list[torch.Tensor]:
    """What a raw rank 0 writes to the wire in each refused case (headers built by hand)."""
    if case == "unannounced":  # announces 6 floats (24 bytes), then a header of 2 floats with 24 bytes
        return [encode_header(NONE, (6,), torch.float32, notice=True), encode_header(NONE, (2,), torch.float32),
                torch.zeros(24, dtype=torch.uint8)]
    if case == "huge notice":  # 4 GB to a link that accepts 1 MB: the receiver posts nothing more
        return [encode_header(NONE, (2**30,), torch.float32, notice=True)]
    if case == "empty with huge dims":  # no bytes, but dims a model dropping the zero would allocate
        return [encode_header(NONE, (0, 2**40), torch.float32)]
    if case == "tuple over the bound":  # each element 600 KB, under the 1 MB bound; the two over it
        element = lambda k, notice: encode_header(NONE, (150_000,), torch.float32, position=k, count=2,  # noqa: E731
                                                  notice=notice)
        return [element(0, True), element(0, False), torch.zeros(600_000, dtype=torch.uint8), element(1, True)]
    notice = encode_header(NONE, (0,), torch.float32, notice=True)  # the second with the (empty) payload announced
    return [notice, notice, torch.empty(0, dtype=torch.uint8)]


REFUSALS = {
    "unannounced": r"rank 0 sent a message of payload sizes \[8\] without announcing",
    "huge notice": r"rank 0 announced a 4,294,967,296-byte tensor",  # before anything is allocated
    "two notices": "two layout notices in a row",
    "empty with huge dims": r"announced a 4,398,046,511,104-byte tensor \[0, 1099511627776\] \(a zero dim counted",
    "tuple over the bound": r"announced a 600,000-byte tensor \[150000\] after 600,000 bytes of its message, "
                            r"over the 1,048,576 bytes",
}


def _raw_peer_rank(rank: int, out_dir: str, case: str) -> None:
    if rank == 0:
        for tensor in _raw_peer_sends(case):
            dist.send(tensor, dst=1, tag=2)
    else:
        link = Link(0, NONE, CPU, CPU, max_message_bytes=2**20, tag=2)
        with pytest.raises(ValueError, match=REFUSALS[case]):
            link.recv()
    dist.barrier()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_raw_peer_breaking_the_layout_protocol_is_refused_in_one_line(tmp_path, case):
    run_gloo_ranks(_raw_peer_rank, 2, tmp_path, args=(case,))


SECRET = bytes(range(32))


def _sealed_longer_rank(rank: int, out_dir: str) -> None:
    """A sealed link agrees a length with its first message; an envelope that then announces a
    longer one (no notice) is refused on the envelope, before its bytes are waited for."""
    forward, backward = Channel(3, 0, 1, "link"), Channel(3, 1, 0, "link")
    if rank == 0:
        link = Link(1, NONE, CPU, CPU, tag=2, sealing=(Sealer(SECRET, forward), Opener(SECRET, backward)))
        link.send(torch.ones(4))
        link.drain()
        header = encode_header(NONE, (64,), torch.float32)
        envelope, _ = Sealer(SECRET, forward).seal(tensor_bytes([header, torch.ones(64)]))
        dist.send(torch.frombuffer(bytearray(envelope), dtype=torch.uint8), dst=1, tag=2)  # its bytes never sent
    else:
        link = Link(0, NONE, CPU, CPU, tag=2, sealing=(Sealer(SECRET, backward), Opener(SECRET, forward)))
        assert torch.equal(link.recv(), torch.ones(4))
        with pytest.raises(SealingError, match=r"refused a message of 392 bytes on link rank 0 -> rank 1, "
                                               r"generation 3 \(the 152 agreed\)"):
            link.recv()
    dist.barrier()


@pytest.mark.timeout(90)
def test_a_sealed_message_longer_than_agreed_is_refused_on_its_envelope(tmp_path):
    run_gloo_ranks(_sealed_longer_rank, 2, tmp_path)
