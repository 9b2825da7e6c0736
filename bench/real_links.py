"""A kernel-shaped link against the agents' own emulation of it: tokens/s of the same two-stage
job over a 50 Mbit/s cross-region link made (a) by tc tbf between network namespaces
(tests/netns.py: the coordinator and each agent in its own namespace, the data plane bound to
the shaped veth) and (b) by the agents' bandwidth emulation (links[].emulate, local agents),
alternated; and the link probe's measured bandwidth ÷ the shaped one on side (a). Defaults on
(compression: auto), so both sides pick their codecs from what their probe measured.
Needs root (namespaces); elsewhere it reports why and measures nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from _clusters import run_cli
from _harness import BenchError, NullReporter, Reporter, Side, alternate, compare, single_thread_env, temporary_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from netns import PORT, GeoNamespaces, netns_missing, run_in_namespaces  # noqa: E402

MBIT = 50
TOKENS_PER_STEP = 8 * 4 * 64  # tiny preset: micro_batch_size 8, 4 micro-batches, seq_len 64
TARGET = 0.85  # the emulation may be optimistic by at most 15%


def cluster(steps: int, kernel: bool) -> str:
    if kernel:
        head = f"coordinator: {{host: 0.0.0.0, port: {PORT}, insecure: true}}\ndata_plane: {{interface: dp0}}\n"
        nodes = ("  - {name: a, region: region-a, launch: remote, device: cpu, layers: [0, 3]}\n"
                 "  - {name: b, region: region-b, launch: remote, device: cpu, layers: [3, 6]}\n")
        links = ""
    else:
        head = ""
        nodes = ("  - {name: a, region: region-a, device: cpu, threads: 1, layers: [0, 3]}\n"
                 "  - {name: b, region: region-b, device: cpu, threads: 1, layers: [3, 6]}\n")
        links = f"links:\n  - {{between: [region-a, region-b], emulate: {{bandwidth_mbps: {MBIT}}}}}\n"
    return (f"name: links-{'kernel' if kernel else 'emulated'}\n{head}model: {{preset: tiny}}\n"
            f"train: {{steps: {steps}, checkpoint_every: 0, seed: 0}}\n{links}nodes:\n{nodes}")


def _records(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records],
            "codecs": [s["forward_codec"] for s in summary["plan"]["stages"]]}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    why = netns_missing()
    if why is not None:
        raise BenchError(f"real_links: {why}")
    reporter = reporter or NullReporter()
    steps, warmup, reps = (30, 5, 1) if quick else (150, 10, 3)
    cache = temporary_dir("hetlaunch-bench-cache-")
    probes: list[float] = []
    reporter.total(2 * reps)

    def kernel_once() -> dict:
        work = temporary_dir("hetlaunch-bench-netns-")
        env = {**single_thread_env(), "HETLAUNCH_CACHE_DIR": str(cache)}
        with GeoNamespaces(MBIT) as geo:
            code, text = run_in_namespaces(geo, work, cluster(steps, True), env, timeout_s=900)
        if code != 0:
            raise BenchError(f"real_links: the namespaced run failed ({code}): {text[-600:]}")
        profile = json.loads((work / "run" / "profile.json").read_text())
        probes.extend(link["bandwidth_bytes_per_s"] * 8 / 1e6 for link in profile["links"] if link.get("nodes"))
        return _records(work / "run")

    def emulated_once() -> dict:
        tmp = run_cli("up", cluster(steps, False), ["--run-dir", "{tmp}/run"], 900, cache)
        return _records(tmp / "run")

    measured = alternate(Side("kernel", f"tc tbf {MBIT} Mbit/s (namespaces)", kernel_once),
                         Side("emulated", f"agents emulate {MBIT} Mbit/s", emulated_once), reps, reporter,
                         retry_budget_s=300)
    result = compare(measured, "kernel", "emulated", TOKENS_PER_STEP, warmup, TARGET)
    probe = statistics.median(probes) if probes else None
    return {
        "description": f"tiny preset, 2 pinned stages across a {MBIT} Mbit/s link: kernel-shaped vs emulated by the agents",
        "config": {"steps": steps, "warmup": warmup, "reps": reps, "kernel": cluster(steps, True),
                   "emulated": cluster(steps, False)},
        **result,
        "probe_mbit": probes,
        "probe_over_shaped": None if probe is None else probe / MBIT,
        "measured": measured,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
