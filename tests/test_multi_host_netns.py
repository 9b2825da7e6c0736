"""Multi-host on one machine: the coordinator in one network namespace, two agents in two others,
the cross-region data link shaped in the kernel (tc tbf, 50 Mbit/s). The data plane is bound to
that link by data_plane.interface; the link probe must measure the kernel's bandwidth."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import hetlaunch_cmd, hetlaunch_env, stop_process
from netns import COORDINATOR_ADDRESSES, GeoNamespaces, netns_missing

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=netns_missing() or "")
SHAPED_MBIT = 50
PORT = 29555  # fixed: the namespaces are ours alone


def _start(cmd: list[str], log, env) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)


def run_in_namespaces(tmp_path, geo: GeoNamespaces, steps: int, interface: str | None = "dp0",
                      timeout_s: float = 150) -> tuple[int, str]:
    """`up` in the coordinator's namespace and one remote agent in each region's; (up's exit code, its output)."""
    token = tmp_path / "token"
    token.write_text("netns-test-token\n")
    data_plane = f"data_plane: {{interface: {interface}}}" if interface else ""
    (tmp_path / "c.yaml").write_text(f"""
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
coordinator: {{host: 0.0.0.0, port: {PORT}, insecure: true, join_timeout_s: 60}}
{data_plane}
nodes:
  - {{name: a, region: region-a, launch: remote, device: cpu, layers: [0, 2]}}
  - {{name: b, region: region-b, launch: remote, device: cpu, layers: [2, 4]}}
""")
    env = hetlaunch_env(OMP_NUM_THREADS="1")
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("up", "a", "b")}
    up = _start(geo.exec("coordinator") + hetlaunch_cmd("up", str(tmp_path / "c.yaml"), "--run-dir",
                                                        str(tmp_path / "run"), "--token-file", str(token)),
                logs["up"], env)
    agents = [_start(geo.exec(n) + hetlaunch_cmd("agent", "--coordinator", f"{COORDINATOR_ADDRESSES[n]}:{PORT}",
                                                  "--name", n, "--token-file", str(token), "--connect-timeout", "30"),
                     logs[n], env) for n in ("a", "b")]
    try:
        up.wait(timeout=timeout_s)
    finally:
        for proc in [up, *agents]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [up, *agents]:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = ""
    for name, log in logs.items():
        log.seek(0)
        text += f"--- {name}\n{log.read()[-3000:]}"
        log.close()
    return up.returncode, text


@pytest.mark.timeout(240)
def test_job_trains_across_namespaces_and_the_probe_measures_the_shaped_link(tmp_path):
    with GeoNamespaces(SHAPED_MBIT) as geo:
        code, text = run_in_namespaces(tmp_path, geo, steps=3)
    assert code == 0, text
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
    profile = json.loads((tmp_path / "run" / "profile.json").read_text())
    measured = [link["bandwidth_bytes_per_s"] for link in profile["links"] if link.get("nodes")]
    assert measured, profile["links"]
    shaped = SHAPED_MBIT * 1e6 / 8
    assert abs(measured[0] / shaped - 1) <= 0.15, f"probe measured {measured[0] * 8 / 1e6:.1f} Mbit/s, shaped {SHAPED_MBIT}"


@pytest.mark.timeout(120)
def test_a_data_plane_interface_the_host_lacks_is_one_line(tmp_path):
    with GeoNamespaces(None) as geo:
        code, text = run_in_namespaces(tmp_path, geo, steps=1, interface="eth9", timeout_s=90)
    assert code == 1, text
    assert "data_plane.interface: 'eth9' is not a network interface of" in text, text
