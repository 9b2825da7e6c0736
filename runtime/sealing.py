"""Sealed messages for the data plane: authenticated encryption, one key per channel.

A channel is one direction of one stream between two ranks in one generation (the activations
rank 3 sends rank 4, say). For each generation the coordinator makes every rank an X25519 key
pair and hands each rank, over the TLS control plane, its own private key and every rank's
public key. Two ranks' keys agree on a secret only the two of them can compute:

    pair secret = X25519(my private key, peer's public key)
    key         = HKDF(pair secret, salt="hetlaunch data plane v1", info="gen=G|S->R|stream")

so a rank can derive the keys of the channels it is an end of and of no others: not those
between two other ranks, nor those of a generation it was not given (a node dropped from the
job, and kept out, learns nothing of the next one's traffic). The coordinator makes one key pair
per rank (53 ms for 1,024 ranks) and sends every rank all the public keys (32 bytes a rank: 33 KB
a rank at 1,024); a rank computes a pair secret only for the peers it talks to (75 us each).

A sealed message is AES-256-GCM (`cryptography`, no home-made cipher) over the plaintext, with
an envelope sent in clear beside it and authenticated as associated data:

    envelope = version, generation, sender, receiver, instance, sequence, plaintext length
    nonce    = instance (4 random bytes, per Sealer) || sequence (8 bytes)

The sender counts its messages from 0. A channel has one Sealer: what a generation builds again
(a live move's sync and tied groups) takes streams of its own, so keys of its own, and a nonce
is never used twice under a key. The receiver accepts sequence 0 of the first instance it hears,
then exactly the next sequence of that instance: a replayed, reordered, dropped, truncated,
altered or foreign message, or a second sender on the channel, fails the tag or the order check
and is refused with SealingError, one line naming the channel.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

VERSION = 1
TAG_BYTES = 16
_ENVELOPE = struct.Struct("<BIIIIQQ")  # version, generation, sender, receiver, instance, sequence, length
ENVELOPE_BYTES = _ENVELOPE.size
SECRET_BYTES = 32
_SALT = b"hetlaunch data plane v1"


# The start of the line a stage fails with when it refuses a message (the coordinator looks for it).
REFUSED = "the data plane refused a sealed message"


class SealingError(RuntimeError):
    """A message that failed authentication or came out of order (one line, names the channel)."""

    def __init__(self, message: str, channel: Channel | None = None):
        super().__init__(message)
        self.channel = channel  # the channel that refused it, where one did


def _aead():
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:  # pragma: no cover - the extra is installed wherever encryption is on
        raise SealingError("an encrypted data plane needs the `cryptography` package: "
                           "pip install 'hetlaunch[tls]'") from None
    return hashes, AESGCM, HKDF


def new_secret() -> bytes:
    """32 random bytes: a secret to seal with where no rendezvous gives one (timing the cipher, tests)."""
    return os.urandom(SECRET_BYTES)


def generation_keys(world_size: int) -> tuple[list[bytes], list[bytes]]:
    """(private keys, public keys), raw 32 bytes each, one X25519 pair per rank of a generation: made
    by the coordinator (Rendezvous.data_plane_private_key / data_plane_public_keys)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    raw = {"encoding": serialization.Encoding.Raw}
    keys = [X25519PrivateKey.generate() for _ in range(world_size)]
    return ([k.private_bytes(format=serialization.PrivateFormat.Raw,
                             encryption_algorithm=serialization.NoEncryption(), **raw) for k in keys],
            [k.public_key().public_bytes(format=serialization.PublicFormat.Raw, **raw) for k in keys])


def pair_secret(private_key: bytes, peer_public_key: bytes) -> bytes:
    """The secret this rank shares with a peer: X25519 of its private key and the peer's public one
    (the same from either end)."""
    _aead()  # the clear error where `cryptography` is missing
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    return X25519PrivateKey.from_private_bytes(private_key).exchange(X25519PublicKey.from_public_bytes(peer_public_key))


def peer_secret(rdzv, peer: int, what: str) -> bytes:
    """The secret this rank shares with `peer` in the rendezvous' generation (a pb.Rendezvous);
    SealingError naming `what` must be sealed where the keys for it did not come."""
    public = rdzv.data_plane_public_keys
    if (not 0 <= peer < len(public) or peer == rdzv.rank or len(public) != rdzv.world_size
            or len(public[peer]) != SECRET_BYTES or len(rdzv.data_plane_private_key) != SECRET_BYTES):
        raise SealingError(f"{what} must be sealed but no data-plane key for rank {peer} came with "
                           f"generation {rdzv.generation}")
    try:
        return pair_secret(rdzv.data_plane_private_key, public[peer])
    except ValueError as e:  # e.g. a public key of all zeros: no shared secret
        raise SealingError(f"{what} must be sealed but rank {peer}'s data-plane key is unusable: {e}") from None


@dataclass(frozen=True)
class Channel:
    """One direction of one stream between two ranks in one generation."""

    generation: int
    sender: int
    receiver: int
    stream: str  # e.g. "activations", "gradients", "sync 0-3"

    def __str__(self) -> str:
        return f"{self.stream} rank {self.sender} -> rank {self.receiver}, generation {self.generation}"

    def key(self, secret: bytes) -> bytes:
        if len(secret) != SECRET_BYTES:
            raise SealingError(f"a channel's secret must be {SECRET_BYTES} bytes (got {len(secret)})")
        hashes, _, HKDF = _aead()
        info = f"gen={self.generation}|{self.sender}->{self.receiver}|{self.stream}".encode()
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(secret)


class Sealer:
    """The sending end of a channel: seals messages in order."""

    def __init__(self, secret: bytes, channel: Channel):
        _, AESGCM, _ = _aead()
        self.channel = channel
        self._aead = AESGCM(channel.key(secret))
        self._instance = struct.unpack("<I", os.urandom(4))[0]
        self._sequence = 0

    def seal(self, plaintext: bytes | memoryview) -> tuple[bytes, bytes]:
        """(envelope, ciphertext with its tag) for the next message."""
        c = self.channel
        envelope = _ENVELOPE.pack(VERSION, c.generation, c.sender, c.receiver, self._instance, self._sequence,
                                  len(plaintext))
        nonce = struct.pack("<IQ", self._instance, self._sequence)
        self._sequence += 1
        return envelope, self._aead.encrypt(nonce, bytes(plaintext), envelope)


class Opener:
    """The receiving end of a channel: opens messages, refusing any that is not the next one."""

    def __init__(self, secret: bytes, channel: Channel):
        _, AESGCM, _ = _aead()
        self.channel = channel
        self._aead = AESGCM(channel.key(secret))
        self._instance: int | None = None  # the one sender this opener hears, from its first message on
        self._next = 0

    def expected_length(self, envelope: bytes, max_bytes: int, place: bool = True) -> int:
        """The ciphertext length an envelope announces, checked before anything is allocated for it,
        and with `place` the envelope's address and place in the stream: an envelope that `open`
        would refuse is refused before a buffer is made for its bytes (a forged one had a receiver
        allocate 64 GiB). Without it, for a receive whose buffer was sized and posted beforehand
        (runtime/sealed_exchange.py), `open` checks them once the bytes are in."""
        fields = self._fields(envelope)
        if place:
            self._check_place(*fields[1:6])
        length = fields[6]
        if length > max_bytes:
            raise SealingError(f"refused a message of {length} bytes on {self.channel} (at most {max_bytes})",
                               self.channel)
        return length + TAG_BYTES

    def open(self, envelope: bytes, ciphertext: bytes | memoryview) -> bytes:
        """The plaintext, or SealingError: altered, foreign, truncated, replayed or out of order."""
        _, generation, sender, receiver, instance, sequence, length = self._fields(envelope)
        c = self.channel
        self._check_place(generation, sender, receiver, instance, sequence)
        if len(ciphertext) != length + TAG_BYTES:
            raise SealingError(f"refused a truncated message on {c}: {len(ciphertext)} bytes, "
                               f"the envelope says {length + TAG_BYTES}", self.channel)
        try:
            from cryptography.exceptions import InvalidTag
        except ImportError:  # pragma: no cover
            raise SealingError("an encrypted data plane needs the `cryptography` package") from None
        try:
            plaintext = self._aead.decrypt(struct.pack("<IQ", instance, sequence), bytes(ciphertext), envelope)
        except InvalidTag:
            raise SealingError(f"refused message {sequence} on {c}: it failed authentication "
                               f"(altered, or sealed under another key)", self.channel) from None
        self._instance, self._next = instance, sequence + 1
        return plaintext

    def _check_place(self, generation: int, sender: int, receiver: int, instance: int, sequence: int) -> None:
        c = self.channel
        if (generation, sender, receiver) != (c.generation, c.sender, c.receiver):
            raise SealingError(f"refused a message addressed to generation {generation}, rank {sender} -> rank "
                               f"{receiver} on {c}", self.channel)
        # One sealer per channel: whatever the job builds again in a generation (a live move's
        # sync groups) takes another stream, so another key. An opener that let a new instance
        # start at message 0 took a recording of the channel's earlier sealer the same way.
        fresh = sequence == 0 and self._instance is None
        if not fresh and (instance != self._instance or sequence != self._next):
            raise SealingError(f"refused message {sequence} on {c}: expected message {self._next} "
                               f"(replayed, reordered or dropped)", self.channel)

    def _fields(self, envelope: bytes) -> tuple[int, ...]:
        if len(envelope) != ENVELOPE_BYTES:
            raise SealingError(f"refused an envelope of {len(envelope)} bytes on {self.channel} "
                               f"(expected {ENVELOPE_BYTES})", self.channel)
        fields = _ENVELOPE.unpack(envelope)
        if fields[0] != VERSION:
            raise SealingError(f"refused a message of envelope version {fields[0]} on {self.channel} "
                               f"(this side speaks {VERSION})", self.channel)
        return fields
