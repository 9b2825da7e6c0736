"""Which provider starts the agents of each `launch:` kind (remote: nobody; they are started by hand)."""

from __future__ import annotations

from hetlaunch.launcher.node_config import NodeConfig
from hetlaunch.launcher.providers.base import AgentProvider


def provider_class(launch: str) -> type[AgentProvider]:
    """Imported on use: a provider may need an optional extra (ray) the others do not."""
    if launch == "local":
        from hetlaunch.launcher.providers.local import LocalProvider
        return LocalProvider
    if launch == "ssh":
        from hetlaunch.launcher.providers.ssh import SshProvider
        return SshProvider
    if launch == "slurm":
        from hetlaunch.launcher.providers.slurm import SlurmProvider
        return SlurmProvider
    if launch == "ray":
        from hetlaunch.launcher.providers.ray import RayProvider
        return RayProvider
    raise ValueError(f"no provider starts agents for launch: {launch}")


def providers_for(nodes: list[NodeConfig]) -> list[AgentProvider]:
    """One provider per kind the nodes use, in the order the kinds first appear."""
    kinds = list(dict.fromkeys(n.launch for n in nodes if n.launch != "remote"))
    return [provider_class(kind)([n for n in nodes if n.launch == kind]) for kind in kinds]
