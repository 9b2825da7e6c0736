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


def _steps(run_dir) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


def _events(run_dir) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


@pytest.mark.timeout(300)
def test_a_cut_data_link_is_found_by_the_watchdog_and_the_job_goes_on_once_it_is_back(tmp_path):
    """`ip link set dp0 down` mid-run: neither worker is frozen, both wait, and gloo alone would
    wait 120 s. The watchdog (5 s here) ends the generation within 1.5 bounds and the job runs it
    again; once the link is back, every step is trained, none twice."""
    import time

    from conftest import wait_for
    from netns import finish_in_namespaces, set_data_link, start_in_namespaces

    steps, watchdog = 400, 5
    cluster = _cluster(steps, "dp0").replace("checkpoint_every: 0}", f"checkpoint_every: 10, watchdog_s: {watchdog}}}")
    run_dir = tmp_path / "run"
    with GeoNamespaces(None) as geo:
        procs, logs = start_in_namespaces(geo, tmp_path, cluster, hetlaunch_env(OMP_NUM_THREADS="1"))
        try:
            wait_for(lambda: len(_steps(run_dir)) >= 20, 150, "20 steps", proc=procs["up"])
            set_data_link(geo, up=False)
            cut_at = time.time()
            # The agents say it first (the coordinator then restarts the generation): the link comes
            # back at once, before the next generation meets over it.
            wait_for(lambda: any("stalled" in (tmp_path / f"{n}.log").read_text() for n in "ab"), 3 * watchdog + 20,
                     "an agent's watchdog to find the stall", proc=procs["up"])
            found_at = time.time()
            set_data_link(geo, up=True)
        finally:
            code, text = finish_in_namespaces(procs, logs, 200)
    assert code == 0, text
    assert found_at - cut_at <= 1.5 * watchdog + 5, found_at - cut_at  # not gloo's 120 s
    restart = next(e for e in _events(run_dir) if e["event"] == "restart")
    assert "stalled" in restart["cause"] and "timed out" in restart["cause"], restart
    assert _steps(run_dir) == list(range(steps))
