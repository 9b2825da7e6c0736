"""ZB-H1 and ZB-H2 against 1F1B at equal memory: tokens/s of one pinned 4-stage pipeline, each
stage in a region of its own, links of 20 ms latency, 8 micro-batches, with `schedule: zb-h1` ÷
the same with `schedule: 1f1b` and every stage's window pinned to 4 (ZB-H1 holds 4 micro-batches
at every stage; 1F1B's own windows would hold 4, 3, 2, 1, and the planner would deepen them over
the latency), alternated; then `schedule: zb-h2` ÷ `1f1b` with every window pinned to 7 (ZB-H2
holds 2S - 1 = 7 at every stage), alternated; then `schedule: zb-v` (the same four nodes, eight
one-layer stages, two per node in a V, cut by the planner) ÷ 1F1B at windows 4, alternated (target
≥ 1.3, the issue's); each side's predicted step (the planner prices a
pinned plan by simulating its schedule) against the measured one.

Each stage emulates a device at a tenth of this CPU's speed (`emulate: speed`): nine tenths of
every stage's compute is a sleep, so four stages on two cores run side by side as four nodes
would (at a quarter, two stages computing at once on one core stretched each other's emulated
time fourfold: measured steps were 1.8-2.7x the prediction), and the bubbles are idle time
rather than time another stage's process takes.
Target: ≥ 1.15 for ZB-H1 (the issue's; the ZB paper's up to 23% is at larger S and M). ZB-H2's
ratio is reported without a target: the planner prices one step, in which ZB-H2's parallelogram
saves nothing over ZB-H1 with equal F, I and W; its deeper window hides latency up to an F per
link, and steps that run back to back without a barrier lose the (S - 1) F ZB-H1 still pays.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir
from _trace import bubble_fractions

MICROBATCHES = 8
TOKENS_PER_STEP = 4 * MICROBATCHES * 64  # micro_batch_size 4, seq_len 64
TARGET = 1.15
TARGET_V = 1.3
LATENCY_MS = 20
TRACE_EVERY = 4  # the sampled steps past the warm-up give each side's bubble fraction, measured and predicted


EQUAL_MEMORY = {"zb-h1": 4, "zb-h2": 7}  # the 1F1B window that holds what each holds at every stage


def cluster(steps: int, schedule: str, window: int = 0) -> str:
    """The pinned pipeline; `window` (1F1B only) pins every stage's window. ZB-V's 8 stages (two
    per node, one layer each) are cut by the planner on the same four nodes (it refuses pinned
    layers); its trace has a track per node, so its bubble fraction is per node, as 1F1B's is per
    stage (one stage per node)."""
    regions = ["r0", "r1", "r2", "r3"]
    # every pair of regions 20 ms apart, not only the pinned chain's neighbours: ZB-V's planner picks
    # its own chain of the four nodes and would otherwise route around the slow links
    links = "\n".join(f"  - {{between: [{a}, {b}], emulate: {{latency_ms: {LATENCY_MS}}}}}"
                      for a, b in itertools.combinations(regions, 2))
    window = f", window: {window}" if window else ""
    device = schedule in ("zb-v", "interleaved-1f1b")
    nodes = "\n".join(f"  - {{name: n{i}, region: {r}, device: cpu, threads: 1, "
                      + ("" if device else f"layers: [{2 * i}, {2 * i + 2}], ")
                      + f"emulate: {{speed: 0.1}}{window}}}" for i, r in enumerate(regions))
    return f"""name: zero-bubble-{schedule}
model: {{preset: tiny, n_layers: 6, seq_len: 64, d_model: 128, n_heads: 4}}
train: {{steps: {steps}, micro_batch_size: 4, num_microbatches: {MICROBATCHES}, schedule: {schedule},
        checkpoint_every: 0, seed: 0}}
observe: {{trace_every: {TRACE_EVERY}}}
links:
{links}
nodes:
{nodes}
"""


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (8, 3, 1) if quick else (20, 4, 3)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(6 * reps)

    def side(key: str, schedule: str, window: int = 0) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(steps, schedule, window), ["--run-dir", "{tmp}/run"], 900, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            summary = json.loads((tmp / "run" / "summary.json").read_text())
            plan = summary["plan"]
            trace = tmp / "run" / "trace.json"
            return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records],
                    "predicted_step_s": plan.get("predicted_step_s"),
                    "nodes_used": len({s["node"] for s in plan["stages"]}), "stages": len(plan["stages"]),
                    # first stage's peak activations ÷ the last's (ZB-V: first node's ÷ last node's)
                    "activation_balance": (summary.get("memory") or {}).get("activation_balance", [None])[0],
                    "bubble_fraction": bubble_fractions(trace, from_step=warmup) if trace.exists() else
                    {"measured": [], "predicted": []}}
        title = {"zb-h1": "ZB-H1", "zb-h2": "ZB-H2", "zb-v": "ZB-V", "1f1b": "1F1B"}[schedule]
        return Side(key, f"{title} (windows {window})" if window else title, once)

    def accuracy(measured: dict) -> dict:
        out = {}
        for key, runs in measured["runs"].items():
            ratios = [statistics.median(r["step_s"][warmup:]) / r["predicted_step_s"]
                      for r in runs if r.get("predicted_step_s")]
            out[key] = statistics.median(ratios) if ratios else None
        return out

    def bubbles(measured: dict) -> dict:
        """Each side's median bubble fraction over its runs' sampled steps, from the trace."""
        return {key: {kind: statistics.median(f for r in runs for f in r["bubble_fraction"][kind]) if any(
                    r["bubble_fraction"][kind] for r in runs) else None for kind in ("measured", "predicted")}
                for key, runs in measured["runs"].items()}

    # The first pair keeps its keys of earlier runs ("1f1b": windows pinned to 4), so results compare.
    measured = alternate(side("zb-h1", "zb-h1"), side("1f1b", "1f1b", EQUAL_MEMORY["zb-h1"]), reps, reporter,
                         retry_budget_s=300)
    result = compare(measured, "zb-h1", "1f1b", TOKENS_PER_STEP, warmup, TARGET)
    measured_h2 = alternate(side("zb-h2", "zb-h2"), side("1f1b@7", "1f1b", EQUAL_MEMORY["zb-h2"]), reps, reporter,
                            retry_budget_s=300)
    h2 = compare(measured_h2, "zb-h2", "1f1b@7", TOKENS_PER_STEP, warmup, TARGET)
    for key in ("figure", "target", "met"):  # no target of its own: reported beside ZB-H1's
        h2.pop(key)
    # ZB-V: 8 stages on the same 4 nodes against 1F1B at windows 4 (ZB-V's peak per node is about
    # 1F1B's first stage's: S micro-batches of one stage's worth of layers, the V-shape's claim)
    measured_v = alternate(side("zb-v", "zb-v"), side("1f1b@4", "1f1b", EQUAL_MEMORY["zb-h1"]), reps, reporter,
                           retry_budget_s=300)
    v = compare(measured_v, "zb-v", "1f1b@4", TOKENS_PER_STEP, warmup, TARGET_V)
    from hetlaunch.runtime.schedules import SCHEDULES, Action, max_in_flight, simulate

    own = {name: SCHEDULES[name].actions(4, MICROBATCHES) for name in ("zb-h1", "zb-h2", "1f1b")}
    run_as = {"zb-h1": own["zb-h1"], "zb-h2": own["zb-h2"],  # the sides as run: 1F1B's windows pinned
              "1f1b": SCHEDULES["1f1b"].actions(4, MICROBATCHES, [EQUAL_MEMORY["zb-h1"]] * 4),
              "1f1b@7": SCHEDULES["1f1b"].actions(4, MICROBATCHES, [EQUAL_MEMORY["zb-h2"]] * 4)}
    held = {name: [max_in_flight(a) for a in per_stage] for name, per_stage in run_as.items()}

    def twice(per_stage):  # two steps back to back, no barrier between the stages
        return [[Action(a.stage_index, a.kind, a.microbatch + k * MICROBATCHES) for k in (0, 1) for a in actions]
                for actions in per_stage]

    return {
        "description": f"4 pinned local stages, one per region, {LATENCY_MS} ms links, {MICROBATCHES} micro-batches, "
                       "each stage emulating a tenth-speed device: schedule zb-h1 vs 1f1b (windows 4), then zb-h2 "
                       "vs 1f1b (windows 7), then zb-v (8 stages, two per node) vs 1f1b (windows 4), defaults on",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "zb-h1": cluster(steps, "zb-h1"),
                   "1f1b": cluster(steps, "1f1b", 4), "zb-h2": cluster(steps, "zb-h2"),
                   "1f1b@7": cluster(steps, "1f1b", 7), "zb-v": cluster(steps, "zb-v")},
        **result,
        "measured_over_predicted": {**accuracy(measured), **accuracy(measured_h2), **accuracy(measured_v)},
        "bubble_fraction": {**bubbles(measured), **bubbles(measured_h2), **bubbles(measured_v)},  # bench/_trace.py
        "zb_v": v,  # ZB-V (8 stages, planner's cut) / 1F1B (4 stages, windows 4): tokens/s, ratio, target 1.3
        "zb_v_nodes_used": [r["nodes_used"] for r in measured_v["runs"]["zb-v"]],
        "activation_balance": {key: [r["activation_balance"] for r in runs]
                               for m in (measured, measured_h2, measured_v) for key, runs in m["runs"].items()},
        "peak_microbatches_held": held,  # per stage, from the forward to the weight gradients
        # F = 1, B = 2 (I = W = 1), free links, own windows: the bubble's shape; back to back, what a step
        # adds when no barrier stands between the stages (ZB-H2's parallelogram: 3M)
        "unit_cost_makespan": {name: simulate(per_stage) for name, per_stage in own.items()},
        "unit_cost_second_step": {name: simulate(twice(per_stage)) - simulate(per_stage)
                                  for name, per_stage in own.items()},
        "zb_h2": h2,  # ZB-H2 / 1F1B at ZB-H2's memory: tokens/s, ratio, pair ratios
        "measured": measured,
        "measured_zb_h2": measured_h2,
        "measured_zb_v": measured_v,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
