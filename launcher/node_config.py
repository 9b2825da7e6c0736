"""The cluster YAML's machines: regions, links, nodes (local, remote, over SSH), the data plane's
network, and discovery of agents that are not listed by name (launcher/cluster_config.py puts them
together)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from hetlaunch.launcher.config_errors import FieldError
from hetlaunch.launcher.config_types import MAX_COUNT, MAX_STEPS, MAX_THREADS, Name, Pair, Strict, YamlFloat
from hetlaunch.launcher.ray_config import RayNodeConfig
from hetlaunch.runtime.labels import LABEL_KEY
from hetlaunch.runtime.registry import MAX_MICROBATCHES


class RegionConfig(Strict):
    name: Name  # a region, e.g. us-east


def _steps_increase(changes: list) -> list:
    """Emulated changes (speed, bandwidth) apply in the order of their at_step, one per step."""
    steps = [c.at_step for c in changes]
    if steps != sorted(set(steps)):
        raise ValueError(f"at_step must increase from one change to the next (got {steps})")
    return changes


# Emulation knobs past these turned into tracebacks once training started (a hostile review): a
# speed of 1e-300 or a latency of 1e300 ms overflowed a timestamp, 1e300 GB of memory an integer,
# 1e-30 GB reported 0 bytes. Far beyond any real device or link, never in the way of one.
MIN_SPEED = 1e-3  # a thousandth of the real speed
MAX_LATENCY_MS = 600_000.0  # ten minutes one way
BANDWIDTH_MBPS = {"ge": 1e-3, "le": 1e9}  # a kilobit to a petabit a second
MEMORY_GB = {"ge": 1e-9, "le": 1e6}  # a byte (tests cap a stage at a kilobyte) to a petabyte


class BandwidthChange(Strict):
    at_step: int = Field(ge=0, le=MAX_STEPS)
    bandwidth_mbps: YamlFloat = Field(**BANDWIDTH_MBPS)


class LinkEmulation(Strict):
    bandwidth_mbps: YamlFloat | None = Field(None, **BANDWIDTH_MBPS)  # megabits/s the link carries (after compression)
    latency_ms: YamlFloat | None = Field(None, ge=0, le=MAX_LATENCY_MS)  # one-way latency added to every message
    # Training only, never profiled (a congested link): from each at_step on the stage boundaries
    # over this link carry that many megabits/s instead.
    bandwidth_changes: Annotated[list[BandwidthChange], AfterValidator(_steps_increase)] = Field(default_factory=list)


class LinkConfig(Strict):
    between: Annotated[tuple[str, str], Pair]  # two distinct region names that nodes use
    emulate: LinkEmulation = Field(default_factory=LinkEmulation)  # only local agents honour it

    @field_validator("between")
    @classmethod
    def _distinct(cls, value: tuple[str, str]) -> tuple[str, str]:
        if value[0] == value[1]:
            raise ValueError(f"needs two different regions (got {value[0]!r} twice)")
        return value


class SpeedChange(Strict):
    at_step: int = Field(ge=0, le=MAX_STEPS)
    speed: YamlFloat = Field(ge=MIN_SPEED, le=1)


class NodeEmulation(Strict):
    speed: YamlFloat = Field(1.0, ge=MIN_SPEED, le=1)  # fraction of real compute speed; < 1 stretches every layer's time
    memory_gb: YamlFloat | None = Field(None, **MEMORY_GB)  # caps the memory the agent reports and may use
    # Training only, never profiled (a straggler, or a node profiled faster than it trains): from
    # each at_step on the node computes at that speed instead.
    speed_changes: Annotated[list[SpeedChange], AfterValidator(_steps_increase)] = Field(default_factory=list)


class DataPlaneConfig(Strict):
    # The network interface gloo and NCCL bind and advertise (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME),
    # so tensors cross only that network and a firewall can be opened on it alone; null: their choice.
    interface: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:@-]{1,15}$")
    # The ports tensors may use. gloo and NCCL bind ephemeral ports and cannot be told which, so
    # this is checked, not set: a stage refuses to start unless the host's ephemeral range
    # (sysctl net.ipv4.ip_local_port_range) lies inside it.
    port_range: Annotated[tuple[int, int], Pair] | None = None
    # Job-wide (top-level data_plane only): seal tensors between nodes of different regions
    # (cross_region), between any two nodes (all), or none (off). runtime/sealing.py. Unset, it is
    # cross_region when the coordinator runs TLS and off otherwise (ClusterConfig resolves it).
    # YAML reads a bare `off` as false: take it as "off".
    encrypt: Annotated[Literal["off", "cross_region", "all"] | None,
                       BeforeValidator(lambda v: "off" if v is False else v)] = None
    # Job-wide: the acknowledgement that `encrypt: off` under coordinator.tls sends tensors
    # between regions in clear text (as coordinator.insecure is for the control plane).
    insecure: bool = False

    @field_validator("port_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 1024 <= value[0] <= value[1] <= 65535:
            raise ValueError(f"must be [low, high] with 1024 <= low <= high <= 65535 (got [{value[0]}, {value[1]}])")
        return value


class NodeConfig(Strict):
    name: Name  # unique node name
    region: Name = "default"  # nodes in different regions talk over a (possibly emulated) link
    # local: started by `hetlaunch up` on this machine; ssh: started by `up` on `host` through the
    # system ssh client; remote: the user (or a service) runs `hetlaunch agent` there; slurm: `up`
    # starts it with srun in its slurm group's allocation (launcher/slurm_config.py); ray: a Ray
    # actor in the cluster of the top-level `ray:` runs it (launcher/providers/ray.py)
    launch: Literal["local", "remote", "ssh", "slurm", "ray"] = "local"
    host: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_\[][A-Za-z0-9_.:\[\]-]*$")  # remote: shown while waiting; ssh: where to log in; slurm: the Slurm node it runs on
    user: str | None = Field(None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")  # ssh only: login name (default: ssh's)
    port: int | None = Field(None, ge=1, le=65535)  # ssh only: the SSH port (default: ssh's)
    ssh_options: list[str] = Field(default_factory=list)  # ssh only: passed to ssh before the host, e.g. [-i, key]
    remote_python: str = Field("python3", min_length=1)  # ssh only: the remote interpreter that has hetlaunch
    slurm: Name | None = None  # slurm only: its group in the top-level slurm: list (default: the only one)
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d{1,4})$")  # auto | cpu | cuda | cuda:N (N < 10,000)
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)  # local nodes only: torch intra-op threads (default: cores / local agents)
    # CUDA only: the share of the GPU's memory this node's stage may allocate (the allocator
    # refuses more; the planner fits stages under it); null: all that is free.
    memory_fraction: YamlFloat | None = Field(None, gt=0, le=1)
    layers: Annotated[tuple[int, int], Pair] | None = None  # [start, end) pinned layer range
    pipeline: int | None = Field(None, ge=0, le=MAX_COUNT)  # with pinned layers: which data-parallel pipeline (0, 1, ...); default 0
    window: int | None = Field(None, ge=1, le=MAX_MICROBATCHES)  # with pinned layers, 1F1B: micro-batches in flight (default: the planner's)
    emulate: NodeEmulation = Field(default_factory=NodeEmulation)  # local nodes only
    data_plane: DataPlaneConfig | None = None  # this node's own; default: the top-level data_plane
    ray: RayNodeConfig | None = None  # launch: ray only: what its bundle needs (default: 1 CPU)

    @field_validator("layers")
    @classmethod
    def _ordered(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(f"must be [start, end) with 0 <= start < end (got [{value[0]}, {value[1]}))")
        return value

    @model_validator(mode="after")
    def _per_launch(self) -> NodeConfig:
        if self.launch != "local":
            for key, why in (("emulate", "only local nodes can emulate speed or memory"),
                             ("threads", "only for local nodes (start the remote agent with its own settings)")):
                if key in self.model_fields_set:
                    raise FieldError((key,), f"{why}; this node has launch: {self.launch}")
        elif self.host is not None:
            raise FieldError(("host",), "only for remote or ssh nodes (a local node runs on this machine)")
        if self.launch == "ssh" and self.host is None:
            raise FieldError(("host",), "required with launch: ssh (the host to log in to, or a Host of ~/.ssh/config)")
        stray = _ssh_option_error(self.ssh_options)
        if stray is not None:
            raise FieldError(("ssh_options",), stray)
        if self.launch != "ssh":
            for key in ("user", "port", "ssh_options", "remote_python"):
                if key in self.model_fields_set:
                    raise FieldError((key,), f"only with launch: ssh (this node has launch: {self.launch})")
        if self.launch != "slurm" and self.slurm is not None:
            raise FieldError(("slurm",), f"only with launch: slurm (this node has launch: {self.launch})")
        if self.launch == "ray" and self.host is not None:
            raise FieldError(("host",), "not with launch: ray (the placement group picks the Ray node)")
        if self.ray is not None and self.launch != "ray":
            raise FieldError(("ray",), f"only with launch: ray (this node has launch: {self.launch})")
        if self.memory_fraction is not None and self.device == "cpu":
            raise FieldError(("memory_fraction",), "only for CUDA devices (on CPU use emulate.memory_gb)")
        return self


class DiscoverConfig(Strict):
    # Take agents that are not listed under `nodes`: any agent with the token (and, under mutual TLS,
    # a valid certificate) that matches joins, under the name, region and devices it announces.
    min_nodes: int = Field(1, ge=1, le=MAX_COUNT)  # `up` fails unless at least this many discovered agents joined by wait_s
    max_nodes: int | None = Field(None, ge=1, le=MAX_COUNT)  # take no more than this many (default: no limit)
    wait_s: YamlFloat = Field(60.0, gt=0)  # start once max_nodes joined, or after this long with >= min_nodes
    regions: list[Name] = Field(default_factory=list)  # only agents started with one of these --region (default: any)
    labels: dict[Annotated[str, Field(pattern=LABEL_KEY)], str] = Field(default_factory=dict)  # every one must match an agent --label

    @model_validator(mode="after")
    def _bounds(self) -> DiscoverConfig:
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise FieldError(("max_nodes",), f"{self.max_nodes} is below min_nodes ({self.min_nodes})")
        return self

    def describe(self) -> str:
        """What `up` will wait for, in words (for `validate` and the waiting message)."""
        count = (f"{self.min_nodes}" if self.max_nodes == self.min_nodes else
                 f"{self.min_nodes} to {self.max_nodes}" if self.max_nodes else f"at least {self.min_nodes}")
        where = f" in region {' or '.join(self.regions)}" if self.regions else ""
        labels = (" labelled " + ", ".join(f"{k}={v}" for k, v in sorted(self.labels.items()))) if self.labels else ""
        return f"{count} discovered agent(s){where}{labels}, waiting up to {self.wait_s:g}s"


# ssh's options that take a value (OpenSSH's ssh(1)): the value is the rest of the word or the next one.
_SSH_VALUED = set("BbcDEeFIiJLlmOoPpQRSWw")


def _ssh_option_error(options: list[str]) -> str | None:
    """Why `options` are not all ssh options with their values, or None. A stray word would be
    taken by ssh as the host to log in to (`[-J, bastion, gpu2]` logs in to gpu2), and everything
    after it as the command."""
    expecting = None
    for word in options:
        if expecting is not None:
            expecting = None
            continue
        if not word.startswith("-") or word in ("-", "--"):
            return f"{word[:80]!r} is not an ssh option (each option, then its value if it takes one)"
        for i, letter in enumerate(word[1:]):
            if letter in _SSH_VALUED:
                if i + 2 == len(word):  # the value is the next word
                    expecting = letter
                break
    if expecting is not None:
        return f"-{expecting} needs a value"
    return None
