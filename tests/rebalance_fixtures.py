"""A cluster, a profile and step reports for the replanner, the straggler watch and the check of
a rebalance, without processes: every figure a test feeds is one it chose."""

from __future__ import annotations

import yaml

from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.adapt.replanner import Replanner
from hetlaunch.launcher.adapt.straggler import StragglerWatch
from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile
from hetlaunch.launcher.run_record import StepRecord

MICROBATCHES = 4


def cluster(names=("a", "b"), steps: int = 100, checkpoint_every: int = 0, rebalance: str = "auto",
            layers: int = 8, max_pipelines: int = 1):
    """Local CPU nodes, no codec anywhere, one pipeline unless asked for more."""
    return parse_cluster(yaml.safe_dump({
        "name": "adapt", "model": {"preset": "tiny", "n_layers": layers, "seq_len": 32, "d_model": 32},
        "train": {"steps": steps, "micro_batch_size": 4, "num_microbatches": MICROBATCHES,
                  "max_pipelines": max_pipelines, "checkpoint_every": checkpoint_every, "rebalance": rebalance},
        "compression": {"intra_region": "none", "cross_region": "none", "sync": "none"},
        "nodes": [{"name": n, "device": "cpu"} for n in names]}))


def profile(per_layer: dict[str, float], layers: int = 8, model: str = "synthetic") -> Profile:
    """Every node `per_layer[node]` seconds a layer and micro-batch, a fast link between any two."""
    return Profile(model=ModelIdentity(description=model, num_layers=layers), micro_batch_size=4, seq_len=32,
                   layers=[LayerInfo(param_bytes=1000, activation_bytes=1000, output_bytes=1000)] * layers,
                   nodes=[NodeProfile(name=n, device="cpu", memory_bytes=2**30, layer_seconds=[t] * layers)
                          for n, t in per_layer.items()],
                   links=[LinkProfile(regions=("default", "default"), bandwidth_bytes_per_s=1e10, latency_s=1e-6)])


def replanner(per_layer: dict[str, float], **cluster_options) -> Replanner:
    names = list(per_layer)
    return Replanner(cluster(tuple(names), **cluster_options), profile(per_layer), lambda: names)


def watched(per_layer: dict[str, float], **cluster_options) -> tuple[StragglerWatch, CurrentPlan, Plan]:
    """A watch of the replanner's first plan, calibrated at the profile's own speeds."""
    planner = replanner(per_layer, **cluster_options)
    current = CurrentPlan()
    watch = StragglerWatch(planner.cluster.train, planner, current)
    plan, _ = planner.first()
    watch.new_generation(current.launch(plan), 0)
    watch.calibrated(planner.measured, {n: 1.0 for n in per_layer})
    return watch, current, plan


def step(n: int, plan: Plan, per_layer: dict[str, float], tokens_per_s: float = 1.0) -> StepRecord:
    """Step `n` of `plan` with each node computing `per_layer[node]` seconds a layer and micro-batch."""
    shares = plan.pipeline_microbatches
    stages = [{"node": s.node, "compute_s": shares[s.pipeline] * s.num_layers * per_layer[s.node]} for s in plan.stages]
    return StepRecord(step=n, loss=1.0, tokens_per_s=tokens_per_s, step_s=1.0 / tokens_per_s, time=0.0, stages=stages)
