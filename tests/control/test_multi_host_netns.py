"""Multi-host on one machine: the coordinator in one network namespace, two agents in two others,
the cross-region data link shaped in the kernel (tc tbf, 50 Mbit/s). The data plane is bound to
that link by data_plane.interface; the link probe must measure the kernel's bandwidth."""

from __future__ import annotations

import json

import pytest

from conftest import hetlaunch_env
from netns import PORT, GeoNamespaces, netns_missing, run_in_namespaces

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=netns_missing() or "")
SHAPED_MBIT = 50


def _cluster(steps: int, interface: str) -> str:
    # Pinned layers: both nodes train, and the boundary crosses the shaped link. With the
    # default compression: auto the codec is still chosen from a profile, so the link is probed.
    return f"""
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
coordinator: {{host: 0.0.0.0, port: {PORT}, insecure: true, join_timeout_s: 60}}
data_plane: {{interface: {interface}}}
nodes:
  - {{name: a, region: region-a, launch: remote, device: cpu, layers: [0, 2]}}
  - {{name: b, region: region-b, launch: remote, device: cpu, layers: [2, 4]}}
"""


@pytest.mark.timeout(240)
def test_job_trains_across_namespaces_and_the_probe_measures_the_shaped_link(tmp_path):
    with GeoNamespaces(SHAPED_MBIT) as geo:
        code, text = run_in_namespaces(geo, tmp_path, _cluster(3, "dp0"), hetlaunch_env(OMP_NUM_THREADS="1"))
    assert code == 0, text
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and {s["node"] for s in summary["plan"]["stages"]} == {"a", "b"}
    profile = json.loads((tmp_path / "run" / "profile.json").read_text())
    measured = [link["bandwidth_bytes_per_s"] for link in profile["links"] if link.get("nodes")]
    assert measured, profile["links"]
    shaped = SHAPED_MBIT * 1e6 / 8
    assert abs(measured[0] / shaped - 1) <= 0.15, f"probe measured {measured[0] * 8 / 1e6:.1f} Mbit/s, shaped {SHAPED_MBIT}"


@pytest.mark.timeout(120)
def test_a_data_plane_interface_the_host_lacks_is_one_line(tmp_path):
    with GeoNamespaces(None) as geo:
        code, text = run_in_namespaces(geo, tmp_path, _cluster(1, "eth9"), hetlaunch_env(OMP_NUM_THREADS="1"), 90)
    assert code == 1, text
    assert "data_plane.interface: 'eth9' is not a network interface of" in text, text


@pytest.mark.timeout(120)
def test_without_the_interface_the_data_plane_cannot_reach_its_peer(tmp_path):
    """The data plane binds where it is told: on ctl0 (not routed to the other region) the peers
    cannot meet, and the job ends with an error instead of hanging."""
    with GeoNamespaces(None) as geo:
        code, text = run_in_namespaces(geo, tmp_path, _cluster(1, "ctl0"), hetlaunch_env(OMP_NUM_THREADS="1"), 100)
    assert code not in (0, None), text
    assert "connect" in text, text  # gloo's own word for it ("connect: Network is unreachable")
