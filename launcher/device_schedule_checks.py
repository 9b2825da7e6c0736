"""What `train.schedule: interleaved-1f1b` and `zb-v` (several stages per node) run with, checked
once in the YAML: each refusal is one line naming the field.

These schedules run pipelines whose nodes each hold several stages (runtime/device_schedules.py):
one, or with a `max_pipelines` number up to that many, synced every step (`auto` is one here).
What is keyed by one stage per node is not lifted for them yet, so it is refused here rather than
failing mid-run: islands (`outer`), pinned `layers:`, `window:` and `pipeline:` (the planner cuts
v·D stages itself), a global batch, live moves and restarts on a straggler (`rebalance`, which
re-cut one stage per node), and codecs for a class of links (`intra_region`, `cross_region`):
every boundary runs uncompressed except those `compression.boundaries` pins, by the index of the
schedule's own stages (boundary s after stage s, of each pipeline; its gradients in the same codec,
so `compression.gradients` other than `same` is refused), and the gradient sync's
`compression.sync` applies. Left at its default, `rebalance` is off for these schedules;
evaluation runs after the step (never in its bubbles); trace.json has one track per node.

`schedule: auto` may choose one of them where the same settings allow it (`auto_refusal`), except
that a rebalance left at its default is not a refusal there: it is off under the schedule chosen.
"""

from __future__ import annotations

from hetlaunch.launcher.config_errors import FieldError, yaml_path
from hetlaunch.runtime.registry import DEVICE_SCHEDULE_NAMES


def several_stages_per_node(schedule: str) -> bool:
    """Does this schedule place several stages on each node?"""
    return schedule in DEVICE_SCHEDULE_NAMES


def check_device_schedule(cluster) -> None:
    """FieldError (one line, naming the field) for what `cluster`'s device schedule cannot run with."""
    train = cluster.train
    if not several_stages_per_node(train.schedule):
        return
    refusal = _refusal(cluster, train.schedule)
    if refusal is not None:
        raise refusal


def auto_refusal(cluster) -> str | None:
    """Why `schedule: auto` may not pick a device schedule for `cluster`, in a few words; None
    where the YAML allows one (auto plans them with as many pipelines as its one-stage-per-node
    plan, and the planner still needs a pipeline of 2 nodes or more in that plan, and the schedule
    to pay: launcher/planning/request.py).
    A `rebalance` the YAML sets to anything but off asks for live moves or restarts on stragglers
    (`true` and `auto` included: written out, it is asked for), which these schedules do not run;
    left at its default it is off under them. Pinned `compression.boundaries` keep auto on one stage
    per node: their indices are that plan's boundaries, not a device schedule's stages'."""
    refusal = _refusal(cluster, DEVICE_SCHEDULE_NAMES[0])
    if refusal is None:
        return "compression.boundaries is set" if cluster.compression.boundaries else None
    if refusal.path == ("train", "rebalance"):
        return f"train.rebalance is {cluster.train.rebalance}"
    return f"{yaml_path(refusal.path)} is set"


def _refusal(cluster, schedule: str) -> FieldError | None:
    """The first of `cluster`'s settings `schedule` (several stages per node) cannot run with."""
    train = cluster.train
    what = f"not supported with train.schedule: {schedule} (several stages per node"
    if train.outer is not None:
        return FieldError(("train", "outer"), f"islands are {what} sync every pipeline every step)")
    if train.global_batch is not None:
        return FieldError(("train", "global_batch"), f"is {what} plan at train.num_microbatches; give that instead)")
    for i, node in enumerate(cluster.nodes):
        for key in ("layers", "window", "pipeline"):
            if getattr(node, key) is not None:
                return FieldError(("nodes", i, key), f"is {what}, cut by the planner into stages of its own)")
    if "rebalance" in train.model_fields_set and train.rebalance != "off":
        return FieldError(("train", "rebalance"), f"{train.rebalance} is {what}; live moves and re-cuts are per "
                                                  f"stage: use off)")
    policy = cluster.compression
    codecs = {k: v for k, v in (("intra_region", policy.intra_region), ("cross_region", policy.cross_region))
              if v not in ("auto", "none")}
    if codecs:
        return FieldError(("compression", next(iter(codecs))), f"a codec for a class of links is {what} run "
                                                               f"uncompressed but for compression.boundaries)")
    if policy.gradients != "same":
        return FieldError(("compression", "gradients"), f"{policy.gradients} is {what}: a pinned boundary's "
                                                        f"gradients take its activations' codec; use same)")
    return None

