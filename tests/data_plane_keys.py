"""Data-plane keys for tests that build a rendezvous by hand in several processes: every process
must hold the same generation's key pairs (the coordinator's generation_keys are random), so they
are made from a seed here. Only tests may do this: a key from a seed is no secret."""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey


def seeded_keys(world_size: int, seed: int = 0) -> tuple[list[bytes], list[bytes]]:
    """(private keys, public keys) of a generation of `world_size` ranks, the same for equal seeds."""
    private = [hashlib.sha256(f"test data-plane key {seed} {rank}".encode()).digest() for rank in range(world_size)]
    public = [X25519PrivateKey.from_private_bytes(key).public_key().public_bytes(
        encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw) for key in private]
    return private, public


def rendezvous_keys(rank: int, world_size: int, seed: int = 0) -> dict:
    """pb.Rendezvous fields giving `rank` its key and every rank's public key (and the world size)."""
    private, public = seeded_keys(world_size, seed)
    return {"world_size": world_size, "data_plane_private_key": private[rank], "data_plane_public_keys": public}
