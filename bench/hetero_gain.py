"""What measuring and planning buys on a mixed cluster: the planned cut vs the even split.

An emulated 4-node cluster, speeds 1, 1, 0.5, 0.25, one region (fast links), a 12-layer
model. Side A: `hetlaunch up` as a user runs it (profile, plan, train). Side B: the same
nodes with `layers:` pinned to an even split (3 each), in YAML order. Alternated A, B.
gain = tokens/s(A) / tokens/s(B). The ideal gain is what a perfectly balanced cut would
give under the cost model, from the same profile: every node's compute per micro-batch
equal (fractional layers allowed), links as in the even split. Both predictions carry the
contention the plan is priced with (four agents share this machine's cores): without it the
ideal assumed cores nobody has. Figure: gain / ideal gain.
Target ≥ 0.9.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from _clusters import BASE_SPEED, NUM_LAYERS, cluster, node, profile, up
from _harness import NullReporter, Reporter, temporary_dir

from hetlaunch.launcher.planning.contention import host_factors, shared_cores, stretched
from hetlaunch.launcher.planning.cost_model import CostModel
from hetlaunch.launcher.planning.profile_file import Profile

TARGET = 0.9
SPEEDS = {"a": 1.0, "b": 1.0, "c": 0.5, "d": 0.25}
MICROBATCHES = 8


def settings(quick: bool) -> dict:
    return {"steps": 10, "warmup": 3, "reps": 1} if quick else {"steps": 16, "warmup": 4, "reps": 2}


def ideal_and_even(prof: Profile) -> tuple[float, float, dict]:
    """Predicted step time of the even split and of a perfectly balanced (fractional) cut, each
    priced with the contention the plan itself is priced with (launcher/planning/contention.py:
    agents on one host share its cores, each stage's compute stretched by processor sharing
    with the others' asks), and the stretch of each host for each."""
    chain = [prof.node(n) for n in SPEEDS]
    per = NUM_LAYERS // len(chain)
    cuts = [(i * per, (i + 1) * per) for i in range(len(chain))]
    even = CostModel(prof, MICROBATCHES, "1f1b").evaluate(chain, cuts)
    even_factors, by_node = shared_cores(prof, [even])
    shared = stretched(prof, by_node)
    even_s = CostModel(shared, MICROBATCHES, "1f1b").evaluate([shared.node(n) for n in SPEEDS], cuts).step_s
    # Balanced: node j runs a fraction of the model proportional to its speed (1 / its full-model
    # time), so every stage computes t per micro-batch and counts whole in the contention model.
    cm = CostModel(prof, MICROBATCHES, "1f1b")
    t = 1.0 / sum(1.0 / cm.compute_s(n, 0, NUM_LAYERS) for n in chain)
    balanced = replace(even, stages=tuple(replace(s, compute_s=t) for s in even.stages))
    ideal_factors = host_factors(prof, [balanced])
    # one host here, and equal stages: each is stretched by the host's factor
    stretch = max((ideal_factors.get(n.host, 1.0) for n in chain), default=1.0)
    links = [(s.link_s, s.latency_s) for s in even.stages]
    t *= stretch
    ideal = cm.step_s(t, max(c for c, _ in links), len(chain) * t + sum(2 * (c + lat) for c, lat in links))
    return ideal, even_s, {"even": even_factors, "ideal": ideal_factors}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    s = settings(quick)
    cache = temporary_dir("hetlaunch-bench-cache-")
    # One pipeline on both sides: the ideal gain below is that of a single balanced chain.
    planned_yaml = cluster("hetero-planned", "".join(node(n, v) for n, v in SPEEDS.items()), s["steps"], MICROBATCHES,
                           train="max_pipelines: 1")
    even_yaml = cluster("hetero-even", "".join(node(n, v, layers=(3 * i, 3 * i + 3))
                                              for i, (n, v) in enumerate(SPEEDS.items())), s["steps"], MICROBATCHES)
    reporter.total(1 + 2 * s["reps"])
    reporter.advance("profile")
    prof = Profile.model_validate(profile(planned_yaml, cache))
    runs = {"planned": [], "even": []}
    for rep in range(s["reps"]):
        for side, yaml in (("planned", planned_yaml), ("even", even_yaml)):
            reporter.advance(f"{side} (run {rep + 1}/{s['reps']})")
            runs[side].append(up(yaml, s["steps"], s["warmup"], cache))
    reporter.advance("done")
    tokens = 8 * MICROBATCHES * 64
    tps = {side: statistics.median(tokens / r["measured_step_s"] for r in rs) for side, rs in runs.items()}
    gain = tps["planned"] / tps["even"]
    ideal, even_predicted, contention = ideal_and_even(prof)
    ideal_gain = even_predicted / ideal
    return {
        "description": "emulated 4 nodes (speeds 1, 1, 0.5, 0.25; one region), 12 layers: tokens/s of the planned "
                       "cut / the even split, and that gain / the ideal gain of a perfectly balanced cut",
        "config": {"speeds": SPEEDS, "base_speed_factor": BASE_SPEED, "num_microbatches": MICROBATCHES, **s},
        "tokens_per_s": tps,
        "gain": gain,
        "ideal_gain": ideal_gain,
        "ideal_priced_with": "the plan's contention model (launcher/planning/contention.py): the compute of agents "
                             "on one host stretched by processor sharing of its cores, each stage asking with the "
                             "chance it computes in the steady part, for the even split and the balanced cut alike",
        "host_stretch": contention,
        "figure": {"name": "gain / ideal gain", "value": gain / ideal_gain, "target": f">= {TARGET}"},
        "met": gain / ideal_gain >= TARGET,
        "planned_stages": runs["planned"][0]["stages"],
        "raw": runs,
    }
