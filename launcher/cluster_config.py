"""The cluster YAML schema: strict, typed, validated once before anything starts.

``load_cluster("cluster.yaml")`` (launcher/cluster_yaml.py) returns a :class:`ClusterConfig` or raises
:class:`ConfigError` with one line that names the file and the field path in the
user's terms, e.g. ``cluster.yaml: nodes[2].regoin: unknown key (did you mean
'region'?)``. Every model forbids unknown keys and is strict about types (a
quoted ``"8"`` is not an integer, ``yes`` is not a string), so a typo never turns
silently into a default. The commented field list in
``cluster_examples/local.yaml`` mirrors this file.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from hetlaunch.launcher.config_errors import FieldError
from hetlaunch.launcher.device_schedule_checks import check_device_schedule
from hetlaunch.launcher.config_types import MAX_NAME, Strict, YamlFloat, is_loopback, starts_alnum
from hetlaunch.launcher.node_config import DataPlaneConfig, DiscoverConfig, LinkConfig, NodeConfig, RegionConfig
from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.slurm_config import SlurmGroup, check_slurm_groups
from hetlaunch.launcher.planning.islands import IslandError, island_groups, pipeline_islands
from hetlaunch.launcher.planning.plan import TilingError, check_layer_tiling
from hetlaunch.launcher.providers.kubernetes import KubernetesConfig, check_cluster as check_kubernetes
from hetlaunch.launcher.model_config import DataConfig, ModelConfig
from hetlaunch.launcher.ray_config import RayConfig
from hetlaunch.launcher.train_config import CheckpointConfig, ObserveConfig, TrainConfig


class TlsConfig(Strict):
    # PEM files, e.g. from `hetlaunch certs init DIR`. With `ca`, agents must present a
    # certificate it signed (mutual TLS); local agents then use agent_cert/agent_key.
    cert: str = Field(min_length=1)  # the coordinator's certificate
    key: str = Field(min_length=1)  # its private key
    ca: str | None = Field(None, min_length=1)  # the CA agents' certificates must chain to; null: server-only TLS
    agent_cert: str | None = Field(None, min_length=1)  # the certificate local agents present
    agent_key: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _pairs(self) -> TlsConfig:
        if (self.agent_cert is None) != (self.agent_key is None):
            raise FieldError(("agent_key" if self.agent_key is None else "agent_cert",),
                             "agent_cert and agent_key go together")
        return self


class CoordinatorConfig(Strict):
    # address the gRPC coordinator (and data-plane rendezvous store) binds: a name or an address, as
    # advertise (a space or a newline in it was called a non-loopback address; a hostile review)
    host: str = Field("127.0.0.1", min_length=1, pattern=r"^[A-Za-z0-9_.:\[\]-]+$")
    port: int = Field(0, ge=0, le=65535)  # 0 = any free port (fine when every agent is local)
    # Prometheus metrics on host:metrics_port (launcher/observers.py; the prometheus extra); null: off, 0: any port
    metrics_port: int | None = Field(None, ge=0, le=65535)
    join_timeout_s: YamlFloat = Field(60.0, gt=0)  # how long `up` waits for every node to register
    # Agents send a heartbeat every interval; one silent for the timeout is declared lost and the
    # job goes on without it. Shorter detects a stopped or cut-off node sooner; too short for the
    # network's hiccups (a WAN pause, a coordinator under load) restarts a generation for nothing.
    heartbeat_interval_s: YamlFloat = Field(0.5, ge=0.1, le=60)
    heartbeat_timeout_s: YamlFloat = Field(4.0, gt=0)
    tls: TlsConfig | None = None  # TLS on the control plane (runtime/tls.py)
    insecure: bool = False  # allow a non-loopback host without tls (the token then crosses in clear text)
    # The host agents started over SSH or by Slurm dial (default: host; this machine's name when host is 0.0.0.0 or ::)
    advertise: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.:\[\]-]+$")

    @model_validator(mode="after")
    def _timeout_spans_heartbeats(self) -> CoordinatorConfig:
        if self.tls is None and not self.insecure and not is_loopback(self.host):
            raise FieldError(("host",), f"binds {self.host} without coordinator.tls: the join token and every command "
                                        "would cross the network in clear text; set coordinator.tls (hetlaunch certs "
                                        "init) or, on a network you trust, insecure: true")
        if self.metrics_port and self.metrics_port == self.port:  # both bind host: the gRPC server takes it first
            raise FieldError(("metrics_port",), f"{self.metrics_port} is coordinator.port too: give each its own")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise FieldError(("heartbeat_timeout_s",), f"{self.heartbeat_timeout_s:g} must be at least twice "
                                                        f"heartbeat_interval_s ({self.heartbeat_interval_s:g}): "
                                                        f"one late heartbeat must not lose a node")
        return self


# Each local node is an agent (and a worker) on this host: a typo of 16,000 nodes must not start them.
MAX_LOCAL_AGENTS = 64

def _none_to(default: Any) -> BeforeValidator:
    return BeforeValidator(lambda v: default() if v is None else v)  # an empty section (`model:`) means defaults


def _auto_compression(value: Any) -> Any:
    if value is None or value == "auto":
        return {}
    if isinstance(value, str):
        raise ValueError(f"must be 'auto' or a mapping such as {{cross_region: int8}} (got {value!r})")
    return value


class ClusterConfig(Strict):
    # run name prefix: 1-64 of a-z, 0-9, '_', '-', starting with a letter or digit
    name: Annotated[str, Field(pattern=r"^[a-z0-9_-]+$", max_length=MAX_NAME), AfterValidator(starts_alnum)] = "job"
    coordinator: Annotated[CoordinatorConfig, _none_to(dict)] = Field(default_factory=CoordinatorConfig)
    model: Annotated[ModelConfig, _none_to(dict)] = Field(default_factory=ModelConfig)
    data: Annotated[DataConfig, _none_to(dict)] = Field(default_factory=DataConfig)
    train: Annotated[TrainConfig, _none_to(dict)] = Field(default_factory=TrainConfig)
    checkpoint: Annotated[CheckpointConfig, _none_to(dict)] = Field(default_factory=CheckpointConfig)
    observe: Annotated[ObserveConfig, _none_to(dict)] = Field(default_factory=ObserveConfig)
    regions: Annotated[list[RegionConfig], _none_to(list)] = Field(default_factory=list)  # regions used by nodes are implied
    links: Annotated[list[LinkConfig], _none_to(list)] = Field(default_factory=list)  # per region pair
    nodes: Annotated[list[NodeConfig], _none_to(list)] = Field(default_factory=list)  # the machines of the job, by name
    discover: DiscoverConfig | None = None  # and/or agents taken as they come (launcher/node_config.py)
    slurm: Annotated[list[SlurmGroup], _none_to(list)] = Field(default_factory=list)  # launch: slurm groups (launcher/slurm_config.py)
    ray: RayConfig | None = None  # the Ray cluster of the launch: ray nodes (launcher/ray_config.py)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)  # every node's, unless it sets its own
    # `auto` (default) or codecs pinned per link class / stage boundary: see launcher/planning/compression.py
    compression: Annotated[CompressionConfig, BeforeValidator(_auto_compression)] = Field(
        default_factory=CompressionConfig)
    kubernetes: KubernetesConfig | None = None  # node groups `hetlaunch deploy k8s` renders (providers/kubernetes.py)

    @model_validator(mode="after")
    def _cross_checks(self) -> ClusterConfig:
        if not self.nodes and self.discover is None:
            raise FieldError(("nodes",), "list at least one node, or take agents as they come with discover:")
        if self.discover is not None and any(n.layers is not None for n in self.nodes):
            raise FieldError(("discover",), "cannot be combined with pinned layers (discovered nodes have none)")
        _first_duplicate([r.name for r in self.regions], "regions", "name", "region")
        _first_duplicate([n.name for n in self.nodes], "nodes", "name", "node name")
        used = sorted({n.region for n in self.nodes})
        seen: dict[frozenset[str], int] = {}
        for i, link in enumerate(self.links):
            for region in link.between:
                if region not in used:
                    raise FieldError(("links", i, "between"), f"region {region!r} is not used by any node (in use: {', '.join(used)})")
            pair = frozenset(link.between)
            if pair in seen:
                raise FieldError(("links", i, "between"), f"duplicate link between {link.between[0]} and {link.between[1]} (also links[{seen[pair]}])")
            seen[pair] = i
        if len(self.local_nodes) > MAX_LOCAL_AGENTS:
            raise FieldError(("nodes",), f"{len(self.local_nodes):,} nodes with launch: local, at most {MAX_LOCAL_AGENTS} "
                                         f"(each is an agent process on this host): use launch: ssh or discover for more")
        if (self.ray is None) != (not any(n.launch == "ray" for n in self.nodes)):
            raise FieldError(("ray",), "required with launch: ray nodes ({address: HOST:PORT of the Ray head, or auto})"
                             if self.ray is None else "set, but no node has launch: ray")
        tls = self.coordinator.tls
        started = [n for n in self.nodes if n.launch != "remote"]  # local, ssh, slurm, ray: `up` starts them
        if tls is not None and tls.ca is not None and tls.agent_cert is None and started:
            raise FieldError(("coordinator", "tls", "agent_cert"), f"required with tls.ca and nodes that `up` starts "
                                                                   f"(launch: {started[0].launch}): under mutual TLS "
                                                                   f"the agents it starts present it")
        check_slurm_groups(self)
        self._check_encryption()
        check_device_schedule(self)
        self._check_layers()
        self._check_islands()
        if self.kubernetes is not None:
            check_kubernetes(self)
        return self

    def _check_encryption(self) -> None:
        """Resolve data_plane.encrypt (unset: cross_region under coordinator.tls, else off) and refuse
        what would leave tensors in clear text across regions without the user saying so."""
        for i, node in enumerate(self.nodes):
            for field in ("encrypt", "insecure"):
                if node.data_plane is not None and field in node.data_plane.model_fields_set:
                    raise FieldError(("nodes", i, "data_plane", field), "is job-wide: set it in the top-level "
                                                                        "data_plane, not per node")
        plane, tls = self.data_plane, self.coordinator.tls
        defaulted = plane.encrypt is None
        if defaulted:
            plane.encrypt = "cross_region" if tls is not None else "off"
        regions = sorted({n.region for n in self.nodes})
        if plane.encrypt == "off" and tls is not None and len(regions) > 1 and not plane.insecure:
            raise FieldError(("data_plane", "encrypt"), f"off sends tensors between regions {', '.join(regions)} in "
                                                        "clear text while the control plane runs TLS: set "
                                                        "data_plane.insecure: true to acknowledge it, or leave "
                                                        "encrypt unset (cross_region)")
        if plane.encrypt != "off" and tls is None and self.coordinator.insecure:
            raise FieldError(("data_plane", "encrypt"), "needs coordinator.tls: the nodes' keys travel on the "
                                                        "control plane, in clear text without it")
        if plane.encrypt != "off" and importlib.util.find_spec("cryptography") is None:
            default = " (the default under coordinator.tls)" if defaulted else ""
            raise FieldError(("data_plane", "encrypt"), f"{plane.encrypt}{default} needs the `cryptography` package "
                                                        "on this machine and every node: pip install 'hetlaunch[tls]'")

    def _check_islands(self) -> None:
        outer = self.train.outer
        if outer is None or not self.nodes:
            return
        names = [n.name for n in self.nodes]
        layers = self.model.num_stage_layers
        if layers is None and all(n.layers is not None for n in self.nodes):  # pins tile the model (`up` checks)
            layers = max(n.layers[1] for n in self.nodes)
        if layers is not None and outer.too_many_fragments(layers):
            raise FieldError(("train", "outer", "fragments"), outer.too_many_fragments(layers))
        if isinstance(outer.islands, list):
            listed = {name for island in outer.islands for name in island}
            for i, island in enumerate(outer.islands):
                for name in island:
                    if name not in names:
                        raise FieldError(("train", "outer", "islands", i), f"node {name!r} is not in nodes "
                                                                           f"({', '.join(names)})")
            missing = [n for n in names if n not in listed]
            if missing:  # discovered nodes not listed are left out of the plan, and the plan says so
                raise FieldError(("train", "outer", "islands"), f"node(s) {', '.join(missing)} are in no island")
        if self.pinned:
            groups = island_groups(outer.islands, [(n.name, n.region) for n in self.nodes])
            try:
                pipeline_islands([[n.name for _, n in members] for members in self.pinned_pipelines()], groups)
            except IslandError as err:
                raise FieldError(("train", "outer", "islands"), str(err)) from None

    def _check_layers(self) -> None:
        if not self.nodes:
            return  # only discovered nodes, checked again when they have joined
        pinned = [n.layers is not None for n in self.nodes]
        num_layers = self.model.num_stage_layers
        if any(pinned) and not all(pinned):
            i = pinned.index(False)
            j = pinned.index(True)
            raise FieldError(("nodes", i, "layers"), f"missing; either every node pins layers or none does (nodes[{j}] does)")
        for i, n in enumerate(self.nodes):
            for key in ("pipeline", "window"):
                if getattr(n, key) is not None and n.layers is None:
                    raise FieldError(("nodes", i, key), "only with pinned layers (the planner places nodes itself)")
            if n.window is not None and self.train.schedule not in ("1f1b", "auto"):  # auto: 1F1B where windows are pinned
                raise FieldError(("nodes", i, "window"), f"only with train.schedule: 1f1b (not {self.train.schedule})")
        shares = self.train.pipeline_microbatches
        if shares is not None and not all(pinned):
            raise FieldError(("train", "pipeline_microbatches"), "only when every node pins layers")
        if all(pinned):
            count = self.pinned_pipeline_count()
            if shares is not None and len(shares) != count:
                raise FieldError(("train", "pipeline_microbatches"), f"has {len(shares)} entries for {count} pipelines")
            if count > self.train.batch_shape()[1]:
                raise FieldError(("train", "num_microbatches"), f"{self.train.batch_shape()[1]} micro-batches cannot feed "
                                                                f"{count} pipelines (each needs one)")
        if num_layers is None:
            return  # entrypoint model: depth known only to the agents; `up` checks the pinned ranges' tiling
        if all(pinned):
            pipelines = self.pinned_pipelines()
            for p, members in enumerate(pipelines):
                try:
                    check_layer_tiling([(f"nodes[{i}].layers", *n.layers) for i, n in members], num_layers)
                except TilingError as exc:  # with several pipelines, say whose layers leave the gap
                    raise FieldError((), (f"pipeline {p}: " if len(pipelines) > 1 else "") + str(exc)) from None
        elif len(self.nodes) > num_layers:
            raise FieldError(("nodes",), f"{len(self.nodes)} nodes but the model has only {num_layers} stage layers "
                                          f"(n_layers + 2); each node needs at least one")

    def pinned_pipeline_count(self) -> int:
        indices = sorted({n.pipeline or 0 for n in self.nodes})
        if indices != list(range(len(indices))):
            missing = min(set(range(indices[-1] + 1)) - set(indices))
            raise FieldError(("nodes",), f"pipelines are numbered 0, 1, ...: no node is in pipeline {missing}")
        return len(indices)

    def pinned_pipelines(self) -> list[list[tuple[int, NodeConfig]]]:
        """(index in nodes, node) of each pinned pipeline, by pipeline."""
        return [[(i, n) for i, n in enumerate(self.nodes) if (n.pipeline or 0) == p]
                for p in range(self.pinned_pipeline_count())]

    @property
    def pinned(self) -> bool:
        """Every node pins its layers: the plan is the YAML's (no planner)."""
        return bool(self.nodes) and all(n.layers is not None for n in self.nodes)

    @property
    def local_nodes(self) -> list[NodeConfig]:
        return [n for n in self.nodes if n.launch == "local"]

    @property
    def remote_nodes(self) -> list[NodeConfig]:
        return [n for n in self.nodes if n.launch == "remote"]

    @property
    def ssh_nodes(self) -> list[NodeConfig]:
        return [n for n in self.nodes if n.launch == "ssh"]

    def data_plane_of(self, node: NodeConfig) -> DataPlaneConfig:
        return node.data_plane or self.data_plane

    def seals(self, a: str, b: str) -> bool:
        """Does data_plane.encrypt cover the tensors between nodes `a` and `b`?"""
        mode = self.data_plane.encrypt
        return mode == "all" or (mode == "cross_region" and self.node(a).region != self.node(b).region)

    def with_discovered(self, found: list[NodeConfig]) -> ClusterConfig:
        """This cluster with the discovered nodes added, validated again as a whole (they must still
        fit the model), and discovery done (and the kubernetes: section, whose pods joined by it, left out)."""
        data = self.model_dump(exclude={"nodes", "discover", "kubernetes"}, exclude_unset=True)
        data["nodes"] = [n.model_dump(exclude_unset=True) for n in self.nodes + found]
        return ClusterConfig.model_validate(_plain(data), strict=False)

    def node(self, name: str) -> NodeConfig:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def link_between(self, region_a: str, region_b: str) -> LinkConfig | None:
        """The link configured for this region pair (either order), or None."""
        for link in self.links:
            if {region_a, region_b} == set(link.between) and region_a != region_b:
                return link
        return None

    def emulated_link(self, a: str, b: str) -> tuple[float, float]:
        """(Mbps, ms) the agents emulate between nodes `a` and `b`; (0, 0) for none. Only local
        agents share a clock to emulate with, and only links between regions are emulated.
        The YAML's knobs for the agents to make true: the planner never sees them."""
        link = self._emulated_link(a, b)
        if link is None:
            return 0.0, 0.0
        return link.emulate.bandwidth_mbps or 0.0, link.emulate.latency_ms or 0.0

    def _emulated_link(self, a: str, b: str):
        """The YAML link the agents of `a` and `b` emulate, if any (local nodes of two regions)."""
        node_a, node_b = self.node(a), self.node(b)
        if node_a.region == node_b.region or node_a.launch != "local" or node_b.launch != "local":
            return None
        return self.link_between(node_a.region, node_b.region)

    def emulated_bandwidth_changes(self, a: str, b: str) -> list[tuple[int, float]]:
        """(at_step, Mbps) the link between `a` and `b` changes to during training (where it is emulated)."""
        link = self._emulated_link(a, b)
        return [] if link is None else [(c.at_step, c.bandwidth_mbps) for c in link.emulate.bandwidth_changes]

    def threads_for(self, node: NodeConfig, cpu_count: int) -> int:
        """torch intra-op threads for a local agent: its own setting, else cores / local agents (>= 1)."""
        if node.threads is not None:
            return node.threads
        return max(1, cpu_count // max(1, len(self.local_nodes)))


def _plain(value: Any) -> Any:
    """A dump made valid input again (tuples back to the lists YAML gives)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _first_duplicate(names: list[str], section: str, key: str, what: str) -> None:
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            raise FieldError((section, i, key), f"duplicate {what} {name!r} (also {section}[{first[name]}])")
        first[name] = i
