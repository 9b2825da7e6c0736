"""A live cluster: the coordinator, the data-plane store, the local agents, every node joined.

`hetlaunch up`, `plan` and `profile` all start one with `with ClusterSession(...) as s:`;
leaving the block (normally, on error, on Ctrl-C or SIGTERM) tells every agent to shut
down and stops every local agent process, so nothing outlives the command.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch.distributed as dist
from rich.console import Console

from hetlaunch.launcher.coordinator import CoordinatorServer
from hetlaunch.launcher.local_agents import LocalAgents
from hetlaunch.protos import control_pb2 as pb

RENDEZVOUS_TIMEOUT_S = 120.0


class JobError(Exception):
    """A one-line reason the job could not run or finish."""


class ClusterSession:
    def __init__(self, cluster, run_dir: Path, token: str, console: Console):
        self.cluster = cluster
        self.run_dir = run_dir
        self.token = token
        self.console = console
        self.nodes = {n.name: n for n in cluster.nodes}
        self.agents = LocalAgents()
        self.server: CoordinatorServer | None = None
        self.store: dist.TCPStore | None = None
        self._generation = 0

    def __enter__(self) -> "ClusterSession":
        coord = self.cluster.coordinator
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.server = CoordinatorServer(coord.host, coord.port, self.token, list(self.nodes)).start()
            self.store = dist.TCPStore(coord.host, 0, is_master=True, wait_for_workers=False)
            self._write_contact()
            for node in self.cluster.local_nodes:
                self.agents.start(node.name, self.server.address, self.token, self.run_dir / "logs",
                                  self.cluster.threads_for(node, os.cpu_count() or 1))
            self._wait_for_nodes()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            for name in self.server.state.agents:
                self.server.state.send(name, pb.Command(shutdown=pb.Shutdown(reason="hetlaunch is done")))
            self.agents.wait_all(5.0)
        self.agents.stop()
        if self.server is not None:
            self.server.stop()
        self.store = None

    @property
    def state(self):
        return self.server.state

    def next_rendezvous(self, rank: int, world_size: int, backend: str) -> pb.Rendezvous:
        """A fresh key prefix on the store for each data-plane group (profiling, each plan)."""
        return pb.Rendezvous(store_host=self._store_host(), store_port=self.store.port, generation=self._generation,
                             rank=rank, world_size=world_size, timeout_s=RENDEZVOUS_TIMEOUT_S, backend=backend)

    def advance_generation(self) -> int:
        self._generation += 1
        return self._generation

    def _store_host(self) -> str:
        # The store binds every interface; an empty host tells agents to dial the coordinator's own host.
        host = self.cluster.coordinator.host
        return "" if host in ("0.0.0.0", "::") else host

    def device_of(self, name: str) -> str:
        node = self.nodes[name]
        if node.device != "auto":
            return node.device
        with self.state.lock:
            info = self.state.agents[name].info
        return "cuda" if any(d.kind == pb.DEVICE_KIND_CUDA for d in info.devices) else "cpu"

    def backend_for(self, names: list[str]) -> str:
        """NCCL only where every rank of the group computes on CUDA."""
        return "nccl" if all(self.device_of(n).startswith("cuda") for n in names) else "gloo"

    def threads_of(self, name: str) -> int:
        node = self.nodes[name]
        return self.cluster.threads_for(node, os.cpu_count() or 1) if node.launch == "local" else 0

    def check_alive(self, done: set[str], heartbeat_timeout: float) -> None:
        for node, code in self.agents.exited().items():
            if node not in done:
                raise JobError(f"local agent {node} exited with code {code}: {self.agents.agents[node].log_tail()}")
        for node, silent in self.state.silent_for(time.monotonic()).items():
            if silent > heartbeat_timeout and node not in done:
                raise JobError(f"lost node {node}: no heartbeat for {silent:.0f}s")

    def _write_contact(self) -> None:
        """Where remote agents (and tests) find the coordinator; the token file only when someone needs it."""
        address = self.server.address
        (self.run_dir / "coordinator.json").write_text(json.dumps({"address": address, "pid": os.getpid()}) + "\n")
        self.console.print(f"coordinator listening on [bold]{address}[/] (run dir {self.run_dir})")
        if self.cluster.remote_nodes:
            token_path = self.run_dir / "token"
            token_path.touch(mode=0o600)
            token_path.write_text(self.token + "\n")
            for node in self.cluster.remote_nodes:
                self.console.print(f"  on {node.host or node.name}: hetlaunch agent --coordinator <this host>:"
                                   f"{self.server.port} --token-file {token_path} --name {node.name}")

    def _wait_for_nodes(self) -> None:
        timeout = self.cluster.coordinator.join_timeout_s
        deadline = time.monotonic() + timeout
        with self.console.status("waiting for agents to join") as status:
            while True:
                missing = self.state.missing_nodes()
                if not missing:
                    return
                with self.state.lock:
                    refusals = dict(self.state.refusals)
                if refusals:
                    node, why = next(iter(refusals.items()))
                    raise JobError(f"node {node} was refused: {why}")
                dead = {n: c for n, c in self.agents.exited().items() if n in missing}
                if dead:
                    node, code = next(iter(dead.items()))
                    raise JobError(f"local agent {node} exited with code {code} before joining: "
                                   f"{self.agents.agents[node].log_tail()}")
                if time.monotonic() > deadline:
                    names = ", ".join(
                        f"{n} ({self.nodes[n].launch}{', host ' + self.nodes[n].host if self.nodes[n].host else ''})"
                        for n in missing)
                    raise JobError(f"nodes never joined within {timeout:g}s: {names}")
                status.update(f"waiting for agents to join: {', '.join(missing)}")
                time.sleep(0.1)
