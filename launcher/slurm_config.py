"""The cluster YAML's `slurm:` section: groups of nodes that share one Slurm allocation (launch: slurm).

    slurm:
      - {name: gpu, partition: gpu, account: lab, gpus_per_node: 1, time: "2:00:00"}
    nodes:
      - {name: a0, launch: slurm, slurm: gpu}
      - {name: a1, launch: slurm, slurm: gpu}

A group asks Slurm for as many nodes as name it (one agent per node); a node's `slurm:` may be
left out when there is one group. A node's `host:` pins the Slurm node it runs on. Groups that
name the same `het_job` are asked for as one heterogeneous job (salloc A : B), started together.
launcher/providers/slurm.py gets the allocation and starts the agents.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator, Field

from hetlaunch.launcher.config_errors import FieldError
from hetlaunch.launcher.config_types import Name, Strict, YamlFloat

# What Slurm accepts as a partition or account name, and as a time limit (minutes, MM:SS,
# HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or UNLIMITED).
_SLURM_WORD = r"^[A-Za-z0-9_.-]{1,64}$"
_SLURM_TIME = r"^(UNLIMITED|INFINITE|\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2})$"


def _quoted(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML reads 2:00:00 as 7200
        raise ValueError(f"quote it, e.g. \"2:00:00\" (YAML read a number, {value!r})")
    return value


def _slurm_time(value: str) -> str:
    if not re.fullmatch(_SLURM_TIME, value):  # re.match's `$` let a trailing newline through
        raise ValueError(f"a Slurm time limit such as 30, 2:00:00 or 1-12:00:00 (got {value!r})")
    return value


class SlurmGroup(Strict):
    name: Name  # what nodes' `slurm:` names
    partition: str | None = Field(None, pattern=_SLURM_WORD)  # default: the cluster's default partition
    account: str | None = Field(None, pattern=_SLURM_WORD)  # default: the user's default account
    gpus_per_node: int | None = Field(None, ge=1, le=1024)  # --gpus-per-node (default: no GPUs requested)
    time: Annotated[str, BeforeValidator(_quoted), AfterValidator(_slurm_time)] | None = None  # the allocation's time limit (default: the partition's)
    # More options for the allocation (salloc takes sbatch's), and for each agent's srun step.
    salloc_options: list[str] = Field(default_factory=list)
    srun_options: list[str] = Field(default_factory=list)
    # The interpreter with hetlaunch on the compute nodes (default: the one running `up`, as on a
    # shared filesystem).
    python: str | None = Field(None, min_length=1)
    wait_s: YamlFloat = Field(300.0, gt=0)  # how long `up` waits for Slurm to start the allocation
    # Groups with the same het_job are one heterogeneous Slurm job, each a component with its own
    # options (e.g. A100 nodes from one partition, L4 from another), started together.
    het_job: Name | None = None

    def option_errors(self) -> tuple[str, str] | None:
        for key in ("salloc_options", "srun_options"):
            for option in getattr(self, key):
                if not option.startswith("-"):
                    return key, f"{option!r} is not an option (each item one option, e.g. --qos=high)"
                if option.split("=", 1)[0] in _REFUSED.get(key, {}):
                    return key, f"{option.split('=', 1)[0]}: {_REFUSED[key][option.split('=', 1)[0]]}"
        return None


# Options that break how `up` runs the job: the token goes to each agent as stdin's first line,
# stdin stays open as its lifeline, and salloc's command holds the allocation.
_REFUSED = {
    "srun_options": {"--pty": "a terminal echoes stdin's first line (the join token) into the agent's log"},
    "salloc_options": {"--no-shell": "up holds the allocation with salloc's command; without one it outlives up"},
}


def check_slurm_groups(cluster) -> None:
    """Every launch: slurm node names a group that exists (or there is exactly one), every group
    has nodes, and `slurm:` appears only where it means something."""
    groups = {g.name: i for i, g in enumerate(cluster.slurm)}
    if len(groups) != len(cluster.slurm):
        names = [g.name for g in cluster.slurm]
        dup = next(n for n in names if names.count(n) > 1)
        raise FieldError(("slurm", names.index(dup, names.index(dup) + 1), "name"), f"duplicate group {dup!r}")
    for i, group in enumerate(cluster.slurm):
        bad = group.option_errors()
        if bad is not None:
            raise FieldError(("slurm", i, bad[0]), bad[1])
    used, pinned = set(), {}
    for i, node in enumerate(cluster.nodes):
        if node.launch != "slurm":
            continue
        # One agent per Slurm node of a group's allocation (it asks one node each); two groups are
        # two allocations, which may share a node that is not exclusive.
        group = node.slurm or (cluster.slurm[0].name if len(cluster.slurm) == 1 else None)
        if node.host and (group, node.host) in pinned:
            raise FieldError(("nodes", i, "host"), f"node {pinned[group, node.host]} is already pinned to Slurm node "
                                                   f"{node.host} (one agent per Slurm node of a group)")
        if node.host:
            pinned[group, node.host] = node.name
        if not cluster.slurm:
            raise FieldError(("slurm",), f"node {node.name} has launch: slurm: add a top-level slurm: list of "
                                         f"groups (partition, account, gpus_per_node, time)")
        if node.slurm is None and len(cluster.slurm) > 1:
            raise FieldError(("nodes", i, "slurm"), f"required with {len(cluster.slurm)} slurm groups "
                                                     f"(one of {', '.join(groups)})")
        name = slurm_group_of(cluster, node).name if node.slurm is None else node.slurm
        if name not in groups:
            raise FieldError(("nodes", i, "slurm"), f"no slurm group {name!r} (groups: {', '.join(groups)})")
        used.add(name)
    for i, group in enumerate(cluster.slurm):
        if group.name not in used:
            raise FieldError(("slurm", i, "name"), f"no node has launch: slurm in group {group.name!r}")


def slurm_group_of(cluster, node) -> SlurmGroup:
    """The group a launch: slurm node belongs to (validated: it exists)."""
    if node.slurm is None:
        return cluster.slurm[0]
    return next(g for g in cluster.slurm if g.name == node.slurm)
