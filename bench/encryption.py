"""What sealing the data plane costs (data_plane.encrypt, runtime/sealing.py): tokens/s of the
embedded default (cluster_examples/local.yaml: 4 local nodes in two regions, the planner's choice
with `compression: auto`) with `encrypt: cross_region` ÷ `off`, alternated side by side
(bench/_harness.py alternate):

* shaped — the default's cross-region link emulated at 200 Mbit/s (and its 5 ms);
* loopback — no emulation: the links are loopback, as fast as this machine copies bytes.

And the cipher alone: AES-256-GCM seal + open of 4 MiB messages on one core (GB/s, CPU seconds
per GB). Targets (issue 26): shaped ≥ 0.97, loopback ≥ 0.90.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from _clusters import run_cli
from _harness import NullReporter, Reporter, Side, alternate, compare, temporary_dir

EXAMPLE = Path(__file__).resolve().parent.parent / "cluster_examples" / "local.yaml"
TARGETS = {"shaped": 0.97, "loopback": 0.90}


def cluster(steps: int, encrypt: str, shaped: bool) -> str:
    data = yaml.safe_load(EXAMPLE.read_text())
    data["name"] = f"encryption-{encrypt.replace('_', '-')}"
    data["train"].update(steps=steps, checkpoint_every=0, rebalance="off")
    data["data_plane"] = {"encrypt": encrypt}
    if shaped:
        data["links"][0]["emulate"]["bandwidth_mbps"] = 200
    else:
        data["links"] = []
    return yaml.safe_dump(data, sort_keys=False)


def cipher_throughput(message_bytes: int = 4 * 2**20, rounds: int = 20) -> dict:
    """Seal and open `rounds` messages on this thread: GB/s each way, CPU seconds per GB sealed + opened."""
    from hetlaunch.runtime.sealing import Channel, Opener, Sealer, new_secret

    secret, channel = new_secret(), Channel(0, 0, 1, "bench")
    sealer, opener = Sealer(secret, channel), Opener(secret, channel)
    plain = bytes(message_bytes)
    sealed = [sealer.seal(plain) for _ in range(2)]  # warm
    for message in sealed:
        opener.open(*message)
    cpu, wall = time.process_time(), time.perf_counter()
    sealed = [sealer.seal(plain) for _ in range(rounds)]
    seal_s = time.perf_counter() - wall
    wall = time.perf_counter()
    for message in sealed:
        opener.open(*message)
    open_s = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    gb = message_bytes * rounds / 1e9
    return {"message_bytes": message_bytes, "seal_gb_per_s": gb / seal_s, "open_gb_per_s": gb / open_s,
            "cpu_s_per_gb_sealed_and_opened": cpu / gb}


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup, reps = (30, 5, 1) if quick else (120, 10, 2)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(2 * 2 * reps + 1)

    def side(encrypt: str, shaped: bool) -> Side:
        def once() -> dict:
            tmp = run_cli("up", cluster(steps, encrypt, shaped), ["--run-dir", "{tmp}/run"], 900, cache)
            records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
            summary = json.loads((tmp / "run" / "summary.json").read_text())
            return {"step_s": [r["step_s"] for r in records], "loss": [r["loss"] for r in records],
                    "plan": summary["plan"]}
        return Side(encrypt, f"encrypt: {encrypt}", once)

    cases = {}
    for name, shaped in (("shaped", True), ("loopback", False)):
        measured = alternate(side("cross_region", shaped), side("off", shaped), reps, reporter, retry_budget_s=300)
        tokens = 8 * 4 * 64  # the example's micro-batch size x micro-batches x the tiny preset's sequence
        cases[name] = {**compare(measured, "cross_region", "off", tokens, warmup, TARGETS[name]),
                       "final_losses": {k: [r["loss"][-1] for r in runs] for k, runs in measured["runs"].items()},
                       "measured": measured}
    reporter.advance("the cipher alone")
    cipher = cipher_throughput()
    shaped = cases["shaped"]["ratio"]
    return {
        "description": "cluster_examples/local.yaml (4 local nodes, 2 regions, compression auto) with "
                       "data_plane.encrypt cross_region vs off; the cipher alone on one core",
        "config": {"steps": steps, "warmup": warmup, "reps": reps,
                   "cluster_shaped": cluster(steps, "cross_region", True)},
        "figure": {"name": "encrypted / clear tokens/s, 200 Mbit/s cross-region link", "value": shaped,
                   "target": f">= {TARGETS['shaped']}"},
        "met": shaped >= TARGETS["shaped"] and cases["loopback"]["ratio"] >= TARGETS["loopback"],
        "cases": cases,
        "cipher": cipher,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
