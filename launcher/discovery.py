"""Agents taken as they come (the YAML's `discover:`): who may join, and the nodes they become.

The coordinator asks `Discovery.refusal` for every agent whose name the YAML does not list; an
agent that matches (region, labels, room left) joins under the name, region and devices it
announces. Once `up` stops waiting, discovery closes: later strangers are refused, while a
discovered node that was lost may still rejoin under its name, like a listed one.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from hetlaunch.launcher.config_types import NAME_RE
from hetlaunch.launcher.node_config import DiscoverConfig, NodeConfig
from hetlaunch.protos import control_pb2 as pb

_HOST = re.compile(r"[A-Za-z0-9_\[][A-Za-z0-9_.:\[\]-]*")
MAX_REMEMBERED_REFUSALS = 8


@dataclass
class Discovery:
    config: DiscoverConfig
    limit: int | None  # most agents to take: max_nodes, or fewer when the model has fewer layers
    taken: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # the last few strangers turned away, and why
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, info: pb.AgentInfo, mismatch: str | bool = False) -> str | None:
        """Take this agent (None) or say why not (`mismatch`: its versions differ from ours).
        Called under the coordinator's lock."""
        with self._lock:
            why = self._refusal(info) or (mismatch or None)
            if why is None:
                self.taken.append(info.node_name)
            else:
                if len(self.refused) >= MAX_REMEMBERED_REFUSALS:
                    self.refused.pop(next(iter(self.refused)))
                self.refused[info.node_name[:64]] = why
            return why

    def _refusal(self, info: pb.AgentInfo) -> str | None:
        name, rule = info.node_name, self.config
        if self.closed:
            return f"node {name[:64]!r} is not in the cluster, and discovery closed when the job started"
        if not NAME_RE.fullmatch(name):
            return f"{name[:64]!r} is not a node name (1-64 of letters, digits, '_', '.', '-')"
        if info.region and not NAME_RE.fullmatch(info.region):
            return f"agent {name!r}: {info.region[:64]!r} is not a region name"
        if rule.regions and info.region not in rule.regions:
            return (f"agent {name!r} is in region {info.region or '(none: --region not given)'}; "
                    f"discover.regions takes {', '.join(rule.regions)}")
        for key, value in sorted(rule.labels.items()):
            if info.labels.get(key) != value:
                return f"agent {name!r} lacks the label {key}={value} that discover.labels asks for"
        if self.limit is not None and len(self.taken) >= self.limit:
            return f"{len(self.taken)} discovered agents have joined already, the most this job takes"
        return None

    def close(self) -> list[str]:
        with self._lock:
            self.closed = True
            return list(self.taken)

    def count(self) -> int:
        with self._lock:
            return len(self.taken)

    def full(self) -> bool:
        return self.limit is not None and self.count() >= self.limit

    def refusals(self) -> str:
        with self._lock:
            return "; ".join(self.refused.values())


def discovered_node(info: pb.AgentInfo) -> NodeConfig:
    """The YAML node a discovered agent stands for: its own name and region, remote, device auto."""
    host = info.hostname if _HOST.fullmatch(info.hostname or "") else None
    return NodeConfig(name=info.node_name, region=info.region or "default", launch="remote", host=host)
