"""Sealed data-plane messages (runtime/sealing.py): what passes, and every way a message is refused."""

from __future__ import annotations

import pytest

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.sealing import (ENVELOPE_BYTES, TAG_BYTES, Channel, Opener, Sealer, SealingError,
                                       generation_keys, new_secret, peer_secret)

SECRET = new_secret()
CHANNEL = Channel(generation=3, sender=1, receiver=2, stream="activations")


def _pair(secret: bytes = SECRET, channel: Channel = CHANNEL) -> tuple[Sealer, Opener]:
    return Sealer(secret, channel), Opener(secret, channel)


def test_messages_open_in_order_and_the_ciphertext_hides_the_plaintext():
    sealer, opener = _pair()
    planted = b"PLANTED-ACTIVATION-PATTERN" * 40
    for i in range(5):
        envelope, sealed = sealer.seal(planted + bytes([i]))
        assert len(envelope) == ENVELOPE_BYTES and len(sealed) == len(planted) + 1 + TAG_BYTES
        assert b"PLANTED" not in sealed and b"PLANTED" not in envelope
        assert opener.expected_length(envelope, 2**20) == len(sealed)
        assert opener.open(envelope, sealed) == planted + bytes([i])


@pytest.mark.parametrize("where", ["ciphertext", "tag", "envelope length", "envelope instance"])
def test_a_flipped_byte_is_refused_naming_the_channel(where):
    sealer, opener = _pair()
    envelope, sealed = sealer.seal(b"x" * 64)
    envelope, sealed = bytearray(envelope), bytearray(sealed)
    if where == "ciphertext":
        sealed[10] ^= 1
    elif where == "tag":
        sealed[-1] ^= 0x80
    elif where == "envelope length":
        envelope[-8] ^= 1
    else:
        envelope[13] ^= 1
    with pytest.raises(SealingError) as error:
        opener.open(bytes(envelope), bytes(sealed))
    message = str(error.value)
    assert "activations rank 1 -> rank 2, generation 3" in message and "\n" not in message


def test_a_replayed_reordered_or_dropped_message_is_refused():
    sealer, opener = _pair()
    first, second, third = (sealer.seal(bytes([i]) * 16) for i in range(3))
    assert opener.open(*first) == bytes([0]) * 16
    with pytest.raises(SealingError, match="replayed, reordered or dropped"):
        opener.open(*first)  # replayed
    with pytest.raises(SealingError, match="expected message 1"):
        opener.open(*third)  # reordered (or the second dropped)
    assert opener.open(*second) == bytes([1]) * 16 and opener.open(*third) == bytes([2]) * 16


def test_an_opener_hears_one_sealer_so_a_recording_cannot_start_over():
    old, opener = _pair()
    old_first = old.seal(b"a" * 8)
    assert opener.open(*old_first) == b"a" * 8
    with pytest.raises(SealingError, match="replayed"):
        opener.open(*old_first)
    # A second sealer on a channel already heard (what a rebuild under the same stream name made):
    # its message 0 is refused like a replay, as the first sealer's recording would be.
    with pytest.raises(SealingError, match="expected message 1"):
        opener.open(*Sealer(SECRET, CHANNEL).seal(b"b" * 8))
    assert opener.open(*old.seal(b"c" * 8)) == b"c" * 8  # the channel itself goes on


def test_a_recording_from_before_a_live_move_is_refused_after_it():
    """A live move builds the sync and tied groups again in the same generation: under the same
    stream names (so the same keys) a fresh opener took the old groups' recorded message 0 as new
    (a hostile review replayed three gradient buckets so). The groups built by move N name their
    streams `... move N` (runtime/stage_move.py), so a recording fails authentication."""
    before = Channel(generation=3, sender=0, receiver=2, stream="sync 0-3")
    after = Channel(generation=3, sender=0, receiver=2, stream="sync 0-3 move 1")
    recorded = [Sealer(SECRET, before).seal(f"grad step {i}".encode()) for i in range(3)][0]
    opener = Opener(SECRET, after)
    with pytest.raises(SealingError, match="failed authentication"):
        opener.open(*recorded)
    assert opener.open(*Sealer(SECRET, after).seal(b"grad step 3")) == b"grad step 3"


def test_a_foreign_key_another_channel_or_generation_is_refused():
    envelope, sealed = Sealer(new_secret(), CHANNEL).seal(b"y" * 32)
    with pytest.raises(SealingError, match="failed authentication"):
        Opener(SECRET, CHANNEL).open(envelope, sealed)
    # The same secret, another stream: another key.
    envelope, sealed = Sealer(SECRET, Channel(3, 1, 2, "gradients")).seal(b"y" * 32)
    with pytest.raises(SealingError, match="failed authentication"):
        Opener(SECRET, CHANNEL).open(envelope, sealed)
    envelope, sealed = Sealer(SECRET, Channel(4, 1, 2, "activations")).seal(b"y" * 32)
    with pytest.raises(SealingError, match="addressed to generation 4"):
        Opener(SECRET, CHANNEL).open(envelope, sealed)


def test_a_truncated_or_oversized_message_is_refused_before_it_is_read():
    sealer, opener = _pair()
    envelope, sealed = sealer.seal(b"z" * 100)
    with pytest.raises(SealingError, match="truncated"):
        opener.open(envelope, sealed[:-1])
    with pytest.raises(SealingError, match="at most 64"):
        opener.expected_length(envelope, 64)
    with pytest.raises(SealingError, match="envelope of 3 bytes"):
        opener.open(b"abc", sealed)
    with pytest.raises(SealingError, match="must be 32 bytes"):
        Sealer(b"short", CHANNEL)


def test_a_stage_names_the_refusing_link_by_its_nodes_and_the_coordinator_reads_them_back():
    """The line a stage fails with (runtime/stage_command.py) is the one the coordinator parses
    into the link at fault (launcher/session.py), worker prefix and all."""
    from hetlaunch.launcher.session import parse_refusal
    from hetlaunch.protos import control_pb2 as pb
    from hetlaunch.runtime.stage_command import _named_refusal

    sealer, opener = _pair()
    envelope, sealed = sealer.seal(b"activations")
    flipped = bytearray(sealed)
    flipped[0] ^= 1
    with pytest.raises(SealingError) as refused:
        opener.open(envelope, bytes(flipped))
    layout = [pb.StagePlace(rank=1, node="tokyo-0"), pb.StagePlace(rank=2, node="paris-1")]
    line = str(_named_refusal(refused.value, layout))
    assert line.startswith("the data plane refused a sealed message from node tokyo-0 (rank 1) to node paris-1 "
                           "(rank 2), generation 3: refused message 0 on activations rank 1 -> rank 2"), line
    assert "failed authentication" in line and "\n" not in line
    assert parse_refusal(f"SealingError: {line}") == ("tokyo-0", "paris-1")
    assert parse_refusal("RuntimeError: Connection closed by peer") is None
    unnamed = SealingError("an encrypted data plane needs the `cryptography` package")
    assert _named_refusal(unnamed, layout) is unnamed  # not a refusal: left as it is


def test_an_envelope_open_would_refuse_is_refused_before_its_bytes_are_received():
    """expected_length checks the address and the place in the stream, not only the length: a
    forged envelope (another generation or ranks, a sequence out of order) announcing a layer's
    worth of bytes had the receiver allocate 64 GiB before anything was authenticated."""
    sealer, opener = _pair()
    assert opener.open(*sealer.seal(b"first")) == b"first"
    foreign, _ = Sealer(SECRET, Channel(999, 42, 43, "activations")).seal(b"x")
    with pytest.raises(SealingError, match="addressed to generation 999"):
        opener.expected_length(foreign, 2**40)
    skipped_ahead = [sealer.seal(b"y") for _ in range(2)][1][0]
    with pytest.raises(SealingError, match="expected message 1"):
        opener.expected_length(skipped_ahead, 2**40)


def _rendezvous(generation: int, world_size: int) -> list[pb.Rendezvous]:
    """What the coordinator gives each rank of a generation (launcher/session.py rendezvous)."""
    private, public = generation_keys(world_size)
    return [pb.Rendezvous(generation=generation, rank=r, world_size=world_size, data_plane_encrypt="all",
                          data_plane_private_key=private[r], data_plane_public_keys=public)
            for r in range(world_size)]


def _x25519(private: bytes, public: bytes) -> bytes:
    """X25519 worked out here, independently of runtime/sealing.py."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    return X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))


def test_two_ranks_agree_on_their_secret_and_no_third_rank_can_open_their_channel():
    ranks = _rendezvous(5, 3)
    public = list(ranks[0].data_plane_public_keys)
    # The pair secret is X25519 of one end's private key and the other's public key: computing it
    # takes a private key of the pair (not only public keys, which every rank holds).
    assert peer_secret(ranks[0], 1, "x") == _x25519(ranks[0].data_plane_private_key, public[1]) \
        == _x25519(ranks[1].data_plane_private_key, public[0]) == peer_secret(ranks[1], 0, "x")
    assert len({peer_secret(ranks[0], 1, "x"), peer_secret(ranks[0], 2, "x"), peer_secret(ranks[1], 2, "x")}) == 3
    channel = Channel(5, 0, 1, "activations")
    envelope, sealed = Sealer(peer_secret(ranks[0], 1, "x"), channel).seal(b"rank 0's activations")
    assert Opener(peer_secret(ranks[1], 0, "x"), channel).open(envelope, sealed) == b"rank 0's activations"
    # Rank 2 holds its private key and the public keys: whatever it can compute from them fails the tag.
    mine = ranks[2].data_plane_private_key
    for guess in (_x25519(mine, public[0]), _x25519(mine, public[1]), mine, *public, bytes(a ^ b for a, b in
                  zip(public[0], public[1]))):
        with pytest.raises(SealingError, match="failed authentication"):
            Opener(guess, channel).open(envelope, sealed)


def test_a_missing_or_unusable_key_is_one_line_naming_what_must_be_sealed():
    ranks = _rendezvous(2, 2)
    with pytest.raises(SealingError, match="the link to rank 1 must be sealed but no data-plane key for rank 1 "
                                            "came with generation 2"):
        peer_secret(pb.Rendezvous(generation=2, rank=0, world_size=2), 1, "the link to rank 1")
    for peer in (5, -1, 0):  # past the world, negative (no Python indexing from the end), its own rank
        with pytest.raises(SealingError, match=f"no data-plane key for rank {peer}"):
            peer_secret(ranks[0], peer, "x")
    short = pb.Rendezvous(generation=2, rank=0, world_size=3, data_plane_private_key=ranks[0].data_plane_private_key,
                          data_plane_public_keys=ranks[0].data_plane_public_keys)
    with pytest.raises(SealingError, match="no data-plane key for rank 1"):  # keys for 2 ranks of 3
        peer_secret(short, 1, "x")
    broken = pb.Rendezvous(generation=2, rank=0, world_size=2, data_plane_private_key=ranks[0].data_plane_private_key,
                           data_plane_public_keys=[ranks[0].data_plane_public_keys[0], bytes(32)])
    with pytest.raises(SealingError, match="rank 1's data-plane key is unusable"):  # all zeros: no shared secret
        peer_secret(broken, 1, "x")
