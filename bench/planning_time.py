"""How long offline planning takes for a large synthetic cluster (one core: the planner is pure Python).

256 nodes of 4 device types (different speeds and memory) in 8 regions with random
inter-region links, a 48-layer model, 256 micro-batches, up to 64 data-parallel pipelines.
Figure: the median wall time of `plan()` over a few repetitions. Target ≤ 5 s.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time

from _harness import NullReporter, Reporter

from hetlaunch.launcher.planning.planner import plan
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile

TARGET_S = 5.0
GiB = 2**30
DEVICE_TYPES = {"H100": (1.0, 80), "A100": (0.6, 40), "V100": (0.3, 16), "L4": (0.25, 24)}  # speed, GiB


def synthetic_profile(num_nodes: int = 256, num_regions: int = 8, num_layers: int = 48, seed: int = 0) -> Profile:
    rng = random.Random(seed)
    base = [0.002] + [0.012] * (num_layers - 2) + [0.004]  # embedding, blocks, head (seconds at speed 1)
    layers = [LayerInfo(param_bytes=50 * 2**20, activation_bytes=300 * 2**20, output_bytes=16 * 2**20)
              for _ in range(num_layers)]
    regions = [f"region-{i}" for i in range(num_regions)]
    nodes = []
    for i in range(num_nodes):
        device = rng.choice(list(DEVICE_TYPES))
        speed, memory_gb = DEVICE_TYPES[device]
        nodes.append(NodeProfile(name=f"node-{i}", region=regions[i % num_regions], device=device,
                                 memory_bytes=memory_gb * GiB, layer_seconds=[b / speed for b in base],
                                 optimizer_seconds=[0.001 / speed] * num_layers))
    links = [LinkProfile(regions=(r, r), bandwidth_bytes_per_s=2.5e10, latency_s=2e-5) for r in regions]
    for a, b in itertools.combinations(regions, 2):
        links.append(LinkProfile(regions=(a, b), bandwidth_bytes_per_s=rng.uniform(1e8, 2e9),
                                 latency_s=rng.uniform(0.01, 0.12)))
    return Profile(model=ModelIdentity(description="synthetic-48", num_layers=num_layers), micro_batch_size=4,
                   seq_len=2048, layers=layers, nodes=nodes, links=links)


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    reps = 1 if quick else 3
    reporter.total(reps)
    profile = synthetic_profile()
    seconds, result = [], None
    for rep in range(reps):
        reporter.advance(f"plan 256 nodes (run {rep + 1}/{reps})")
        started = time.perf_counter()
        result = plan(profile, num_microbatches=256, schedule="1f1b", max_pipelines=64)
        seconds.append(time.perf_counter() - started)
    reporter.advance("done")
    figure = statistics.median(seconds)
    return {
        "description": "offline plan() of a synthetic 256-node profile (4 device types, 8 regions, 48 layers, "
                       "256 micro-batches, up to 64 pipelines); median wall seconds, one process",
        "config": {"nodes": 256, "device_types": list(DEVICE_TYPES), "regions": 8, "layers": 48,
                   "num_microbatches": 256, "max_pipelines": 64},
        "figure": {"name": "planning seconds", "value": figure, "target": f"<= {TARGET_S}"},
        "runs_s": seconds,
        "met": figure <= TARGET_S,
        "plan": {"pipelines": [len(p.cost.stages) for p in result.pipelines],
                 "microbatches": [p.cost.num_microbatches for p in result.pipelines],
                 "predicted_tokens_per_s": result.tokens_per_s, "method": result.method,
                 "nodes_left_out": len(result.excluded)},
    }
