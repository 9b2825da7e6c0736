"""The sealed data plane on a real wire between two hosts: the coordinator (mutual TLS) and two
agents in network namespaces of their own, the data plane bound to the veth between the two
regions (data_plane.interface: dp0). A capture of that veth, taken inside region a's namespace
while the job trains, holds the activation pattern layer 0 plants with `encrypt: off` (which
under TLS must be acknowledged with `insecure: true`) and never with the default, cross_region."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TESTS_DIR, hetlaunch_env, run_hetlaunch, wait_for
from netns import COORDINATOR_ADDRESSES, PORT, GeoNamespaces, netns_missing, run_in_namespaces
from user_model import PLANTED, PLANTED_WIDTH

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=netns_missing() or "")


def _cluster(certs: Path, data_plane: str) -> str:
    return f"""
model: {{entrypoint: "user_model:make_planted_lm", kwargs: {{d: 32, n_hidden: 1, seq_len: 16}}}}
train: {{steps: 6, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
compression: {{intra_region: none, cross_region: none, sync: none}}
coordinator: {{host: 0.0.0.0, port: {PORT}, join_timeout_s: 60,
               tls: {{cert: {certs}/coordinator.pem, key: {certs}/coordinator.key, ca: {certs}/ca.pem}}}}
data_plane: {{interface: dp0{data_plane}}}
nodes:
  - {{name: a, region: region-a, launch: remote, device: cpu, layers: [0, 1]}}
  - {{name: b, region: region-b, launch: remote, device: cpu, layers: [1, 3]}}
"""


def _captured(geo: GeoNamespaces, workdir: Path, cluster: str, certs: Path, pattern: bytes) -> tuple[dict, str]:
    """Train with `cluster` while capturing region a's dp0: ({"packets", "found"}, the logs)."""
    out = workdir / "capture.json"
    capture = subprocess.Popen(geo.exec("a") + [sys.executable, str(TESTS_DIR / "wire_capture.py"), "dp0",
                                                pattern.hex(), str(out)])
    try:
        wait_for(lambda: Path(str(out) + ".ready").exists(), 30, "the capture to listen", proc=capture)
        code, text = run_in_namespaces(geo, workdir, cluster, hetlaunch_env(OMP_NUM_THREADS="1"), 200,
                                       ("--ca", f"{certs}/ca.pem", "--cert", f"{certs}/agent.pem",
                                        "--key", f"{certs}/agent.key", "--allow-entrypoint", "user_model:make_planted_lm"))
        assert code == 0, text
    finally:
        capture.send_signal(signal.SIGTERM)
        capture.wait(20)
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return json.loads(out.read_text()), text


@pytest.mark.timeout(500)
def test_a_capture_of_the_veth_between_regions_holds_the_planted_activations_only_with_encrypt_off(tmp_path):
    certs = tmp_path / "certs"
    made = run_hetlaunch("certs", "init", str(certs), "--host", COORDINATOR_ADDRESSES["a"],
                         "--host", COORDINATOR_ADDRESSES["b"], timeout=60)
    assert made.returncode == 0, made.stderr
    pattern = struct.pack("<f", PLANTED) * PLANTED_WIDTH
    seen = {}
    with GeoNamespaces(None) as geo:
        for name, data_plane in (("off", ", encrypt: off, insecure: true"), ("default", "")):
            workdir = tmp_path / name
            workdir.mkdir()
            result, text = _captured(geo, workdir, _cluster(certs, data_plane), certs, pattern)
            assert result["packets"] > 100, (result, text)  # the data plane did cross the veth
            seen[name] = result["found"]
            summary = json.loads((workdir / "run" / "summary.json").read_text())
            assert summary["steps"] == 6, summary
    assert seen == {"off": True, "default": False}
