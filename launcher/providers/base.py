"""The interface every way of starting agents implements, and what `up` hands each one.

A provider owns the agents of the nodes whose `launch:` is its kind. `ClusterSession`
(launcher/session.py) builds one per kind in the YAML, calls `preflight` before anything
exists (a missing tool fails there, leaving no run directory behind), `start` once the coordinator
listens, asks `exited` while it waits and trains (an agent whose process or job ended is a lost
node), `kill`s a node declared lost, and `stop`s them all when `up` ends, however it ends: the
lifeline rule. A provider that cannot start its agents raises JobError with one line.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from hetlaunch.launcher.node_config import NodeConfig


@dataclass(frozen=True)
class LaunchContext:
    """What starting an agent needs, whoever starts it."""

    cluster: object  # ClusterConfig (not imported: it imports the node types this package uses)
    coordinator: str  # host:port the coordinator listens on, as this machine reaches it
    port: int  # the port alone, for providers whose agents dial an advertised host
    token: str  # the join token: on stdin, in an environment variable or a file, never on a command line
    log_dir: Path  # runs/<id>/logs: each node's agent output, <node>.log
    agent_args: list[str]  # TLS and policy options every agent `up` starts takes (runtime/agent.py)
    console: Console

    def log_path(self, node: str) -> Path:
        return self.logs() / f"{node}.log"

    def logs(self) -> Path:
        """The logs folder, made if need be. Only this user reads agents' logs: they hold what
        agents print (paths, addresses, and whatever a misconfigured remote terminal echoed)."""
        self.log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_dir.chmod(0o700)
        return self.log_dir


class AgentProvider(ABC):
    """Starts, watches and stops the agents of some nodes."""

    launch: str  # the `launch:` value it serves
    what: str  # how a message names one of its agents, e.g. "local agent"

    def __init__(self, nodes: list[NodeConfig]):
        self.nodes = nodes

    def preflight(self) -> None:
        """JobError (one line) if this machine cannot start these agents at all (a tool missing):
        asked before the run directory, the coordinator or any agent exists."""

    @abstractmethod
    def start(self, ctx: LaunchContext) -> None:
        """Start an agent for every node; JobError (one line) if they cannot be."""

    @abstractmethod
    def exited(self) -> dict[str, int]:
        """Nodes whose agent has ended, with an exit code (negative: the signal that ended it)."""

    @abstractmethod
    def log_tail(self, node: str) -> str:
        """The last lines the node's agent wrote, joined on one line ("" if none)."""

    @abstractmethod
    def kill(self, node: str) -> None:
        """End one node's agent now (it was declared lost)."""

    @abstractmethod
    def wait(self, timeout_s: float) -> bool:
        """Whether every agent ended within `timeout_s` (after the coordinator told them to)."""

    @abstractmethod
    def stop(self, grace_s: float = 5.0) -> None:
        """End every agent still running, the gentle way first; return only when they are gone
        (or after a last hard kill)."""


class Providers:
    """The providers of one session, used as one."""

    def __init__(self, providers: list[AgentProvider]):
        self.providers = providers
        self.owner = {n.name: p for p in providers for n in p.nodes}

    def preflight(self) -> None:
        for provider in self.providers:
            provider.preflight()

    def start(self, ctx: LaunchContext) -> None:
        for provider in self.providers:
            provider.start(ctx)

    def exited(self) -> dict[str, int]:
        return {n: c for p in self.providers for n, c in p.exited().items()}

    def what(self, node: str) -> str:
        provider = self.owner.get(node)
        return provider.what if provider is not None else "agent"

    def log_tail(self, node: str) -> str:
        provider = self.owner.get(node)
        return provider.log_tail(node) if provider is not None else ""

    def kill(self, node: str) -> None:
        provider = self.owner.get(node)
        if provider is not None:
            provider.kill(node)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        return all([p.wait(max(deadline - time.monotonic(), 0.01)) for p in self.providers])

    def stop(self, grace_s: float = 5.0) -> None:
        for provider in self.providers:  # each stops its own; one failing must not spare the others
            try:
                provider.stop(grace_s)
            except Exception as err:  # noqa: BLE001 - reported, and the rest still stop
                print(f"stopping {provider.launch} agents failed: {err}", flush=True)
