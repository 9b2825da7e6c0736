"""What data-plane keys the coordinator hands each rank (launcher/session.py rendezvous): its own
X25519 private key and every rank's public key, new each generation; never a secret of the job's
from which the keys of other ranks' channels could be derived (runtime/sealing.py)."""

from __future__ import annotations

import pytest
from rich.console import Console

from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.coordinator_state import CoordinatorState
from hetlaunch.launcher.session import ClusterSession
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.sealing import Channel, Opener, Sealer, SealingError, peer_secret

pytestmark = pytest.mark.quick
NODES = "abc"


def _session(tmp_path, encrypt: str) -> ClusterSession:
    nodes = "\n".join(f"  - {{name: {name}, region: r{i}}}" for i, name in enumerate(NODES))
    cluster = parse_cluster(f"name: keys\nmodel: {{preset: tiny}}\ndata_plane: {{encrypt: {encrypt}, insecure: true}}\n"
                            f"coordinator: {{tls: {{ca: ca.pem, cert: c.pem, key: k.pem, agent_cert: a.pem, agent_key: ak.pem}}}}\nnodes:\n{nodes}\n")
    session = ClusterSession(cluster, tmp_path / "run", "token", Console(quiet=True))
    session.server = type("Server", (), {"state": CoordinatorState(list(NODES))})()
    return session


def _generation(session: ClusterSession) -> list[pb.Rendezvous]:
    session.begin_generation()
    return [session.rendezvous(rank, len(NODES), "gloo", name) for rank, name in enumerate(NODES)]


def test_each_rank_gets_its_own_private_key_and_every_public_key(tmp_path):
    ranks = _generation(_session(tmp_path, "all"))
    private = [r.data_plane_private_key for r in ranks]
    assert all(len(key) == 32 for key in private) and len(set(private)) == 3
    assert all(list(r.data_plane_public_keys) == list(ranks[0].data_plane_public_keys) for r in ranks)
    assert not any(key in r.data_plane_public_keys for r in ranks for key in private)  # no private key is public
    assert peer_secret(ranks[0], 2, "x") == peer_secret(ranks[2], 0, "x")
    channel = Channel(ranks[0].generation, 0, 2, "activations")
    envelope, sealed = Sealer(peer_secret(ranks[0], 2, "x"), channel).seal(b"across regions")
    assert Opener(peer_secret(ranks[2], 0, "x"), channel).open(envelope, sealed) == b"across regions"
    for guess in (peer_secret(ranks[1], 0, "x"), peer_secret(ranks[1], 2, "x")):  # rank 1 is no end of it
        with pytest.raises(SealingError):
            Opener(guess, channel).open(envelope, sealed)


def test_every_generation_gets_new_keys_and_an_unsealed_job_none(tmp_path):
    session = _session(tmp_path, "cross_region")
    first, second = _generation(session), _generation(session)
    assert second[0].generation == first[0].generation + 1
    assert not set(first[0].data_plane_public_keys) & set(second[0].data_plane_public_keys)
    assert session.rendezvous(0, 3, "gloo", "a").data_plane_private_key == second[0].data_plane_private_key
    # A rank given only the first generation's keys opens nothing of the second's.
    channel = Channel(second[0].generation, 0, 1, "activations")
    envelope, sealed = Sealer(peer_secret(second[0], 1, "x"), channel).seal(b"generation 2")
    for guess in (peer_secret(first[1], 0, "x"), peer_secret(first[1], 2, "x")):
        with pytest.raises(SealingError):
            Opener(guess, channel).open(envelope, sealed)
    # One generation's keys are for its world size: asking for another would part the ranks.
    with pytest.raises(ValueError, match="keys are for 3 ranks"):
        session.rendezvous(0, 4, "gloo", "a")
    with pytest.raises(ValueError, match="keys are for 3 ranks"):
        session.rendezvous(3, 3, "gloo", "a")
    unsealed = _generation(_session(tmp_path, "off"))
    assert all(not r.data_plane_private_key and not r.data_plane_public_keys for r in unsealed)
