"""A real Ray cluster on this machine for the tests: a head node and a second node process, each
with its own custom resources (standing in for a region or a GPU type), small (2 CPUs, 100 MB of
object store, no dashboard). Torn down by killing exactly the processes our two `ray start`s left
behind (they run in sessions of their own), never `ray stop`, which would end every Ray on the host."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

OBJECT_STORE_BYTES = 100 * 1024 * 1024


def ray_missing() -> str | None:
    """Why a Ray cluster cannot run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return "needs ray: pip install 'hetlaunch[ray]' (the dev extra and .ci/run install it)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayCluster:
    address: str  # host:port of the head's GCS, what `ray.address` names
    temp_dir: Path
    sessions: list[int] = field(default_factory=list)  # session ids of the `ray start`s: every daemon is in one

    def processes(self) -> list[int]:
        """Pids of the processes this cluster started that are still running (not zombies)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if os.getsid(int(entry)) in self.sessions and state != "Z":
                        pids.append(int(entry))
                except OSError:
                    pass
        return pids

    def stop(self) -> None:
        for _ in range(3):
            pids = self.processes()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ray_start(args: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int:
    """Run `ray start ARGS` in a new session; its session id (the daemons it leaves stay in it)."""
    ray = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())", "start"]
    with open(log, "a") as out:
        proc = subprocess.Popen([*ray, *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    if code != 0:
        raise RuntimeError(f"ray start {' '.join(args[:2])} failed ({code}): {log.read_text()[-2000:]}")
    return proc.pid


def _node_args(resources: dict[str, float], cpus: int) -> list[str]:
    return ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
            f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]


def start_ray_cluster(head_resources: dict[str, float], node_resources: dict[str, float], env: dict[str, str],
                      cpus: int = 2, timeout_s: float = 90) -> RayCluster:
    """A head with `head_resources` and a second node with `node_resources`; `env` is what their
    workers (our actors) inherit, PYTHONPATH included."""
    temp_dir = Path(tempfile.mkdtemp(prefix="hlray", dir="/tmp"))  # short: Ray's socket paths must fit
    port = free_port()
    cluster = RayCluster(f"127.0.0.1:{port}", temp_dir)
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0"}
    log = temp_dir / "start.log"
    try:
        cluster.sessions.append(_ray_start(["--head", f"--port={port}", "--include-dashboard=false",
                                            f"--ray-client-server-port={free_port()}", f"--temp-dir={temp_dir}",
                                            *_node_args(head_resources, cpus)], env, log, timeout_s))
        cluster.sessions.append(_ray_start([f"--address={cluster.address}", *_node_args(node_resources, cpus)],
                                           env, log, timeout_s))
    except BaseException:
        cluster.stop()
        raise
    return cluster
