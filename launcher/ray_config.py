"""The cluster YAML's Ray settings (launch: ray, launcher/providers/ray.py): the job-wide `ray:`
section (which Ray cluster, how its placement group is spread, how long to wait) and a node's own
`ray:` (what its bundle asks of a Ray node: CPUs, GPUs, a GPU type, custom resources)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from hetlaunch.launcher.config_types import Strict, YamlFloat

# Ray resource names as `ray start --resources` takes them, e.g. region_us_east, or accelerator_type:A100.
ResourceName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,127}$")]
_RAY_OWN = ("CPU", "GPU", "memory", "object_store_memory")


class RayConfig(Strict):
    # host:port of the Ray cluster's head (its GCS, as `ray start --head` prints it), or `auto`:
    # the cluster `ray start` runs on this machine (or $RAY_ADDRESS). Ray client (ray://) is not supported:
    # `up` is the driver, so that Ray ends the agents' actors when `up` ends.
    address: str
    # How the bundles (one per launch: ray node) spread over Ray nodes: SPREAD (default, best
    # effort), STRICT_SPREAD (every agent on a different Ray node, or fail), PACK, STRICT_PACK.
    strategy: Literal["SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK"] = "SPREAD"
    connect_timeout_s: YamlFloat = Field(30.0, gt=0)  # for ray.init to reach the cluster
    placement_timeout_s: YamlFloat = Field(120.0, gt=0)  # for the placement group (an autoscaler may add nodes)

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value != "auto" and not re.fullmatch(r"[A-Za-z0-9_.-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}", value):
            raise ValueError(f"must be HOST:PORT of the Ray head (as `ray start --head` prints it) or auto; "
                             f"Ray client (ray://) is not supported (got {value!r})")
        if value != "auto" and not 1 <= int(value.rsplit(":", 1)[1]) <= 65535:  # 99999 was dialled as 34463
            raise ValueError(f"port {value.rsplit(':', 1)[1]} is not a TCP port (1-65535)")
        return value


class RayNodeConfig(Strict):
    num_cpus: YamlFloat = Field(1.0, ge=1)  # the agent's CPUs (also its torch threads, rounded down)
    num_gpus: YamlFloat = Field(0.0, ge=0)  # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it grants
    # A GPU type Ray detected (its accelerator_type:<type> resource), e.g. A100, L4, V100
    gpu_type: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    # Custom resources the node's bundle needs, e.g. {region_us_east: 1} for a Ray node started
    # with `ray start --resources='{"region_us_east": 8}'`.
    resources: dict[ResourceName, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(default_factory=dict)

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        # Checked here, not by Ray once the cluster is reached: Ray refuses these as custom
        # resources, and fractions finer than it counts, with a traceback from inside `up`.
        for name, amount in value.items():
            if name in _RAY_OWN:
                raise ValueError(f"{name}: a resource Ray sets itself (use num_cpus, num_gpus, gpu_type)")
            if amount < 1e-4:  # Ray counts resources in ten-thousandths: less is none at all to it
                raise ValueError(f"{name}: {amount:g} is finer than Ray counts (at least 0.0001)")
        return value

    def bundle(self) -> dict[str, float]:
        """The node's placement group bundle (and its actor's resources)."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.gpu_type:  # Ray's own convention for accelerator_type: a sliver of the marker resource
            bundle[f"accelerator_type:{self.gpu_type}"] = 0.001
        return bundle
