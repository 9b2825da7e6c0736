"""What compression buys across a slow link: tokens/s and final loss per codec.

Two nodes in two regions joined by an emulated 20 Mbps / 40 ms link (the agents hold each
message for its time on the wire: kernel shaping with tc/netem is not used here), a small
model whose activations make the link the bottleneck, the cut pinned at the middle so every
codec crosses the same boundary. (At 50 Mbps this model's compute on 2 CPU cores already
caps the gain near 2.7x: once the link is off the critical path, no codec helps more.) GPipe, so 16 micro-batches stream over the 40 ms link (1F1B
would keep only 2 in flight across it). Codecs: none, fp16, int8, int4_rotated pinned, and
auto (the planner measures the link and picks). Same seeds and steps for all: the final loss
is the mean of the last 10 steps. Targets: int8 >= 3x none; auto >= 4.3x none with final
loss within 2% of none.
"""

from __future__ import annotations

import json
import statistics
import sys

from _clusters import run_cli
from _harness import NullReporter, Reporter, temporary_dir

CODECS = ("none", "fp16", "int8", "int4_rotated", "auto")
TARGET_INT8, TARGET_AUTO, TARGET_LOSS = 3.0, 4.3, 0.02


def cluster(codec: str, steps: int) -> str:
    return f"""name: compression-{codec.replace('_', '-')}
model: {{preset: tiny, n_layers: 2, seq_len: 128, d_model: 32, n_heads: 4}}
train: {{steps: {steps}, micro_batch_size: 8, num_microbatches: 16, schedule: gpipe, lr: 1.0e-3, seed: 0}}
links:
  - between: [us, eu]
    emulate: {{bandwidth_mbps: 20, latency_ms: 40}}
compression: {{cross_region: {codec}}}
nodes:
  - {{name: us-1, region: us, device: cpu, threads: 1, layers: [0, 2]}}
  - {{name: eu-1, region: eu, device: cpu, threads: 1, layers: [2, 4]}}
"""


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    steps, warmup = (12, 3) if quick else (40, 5)
    cache = temporary_dir("hetlaunch-bench-cache-")
    reporter.total(len(CODECS))
    results = {}
    for codec in CODECS:
        reporter.advance(codec)
        tmp = run_cli("up", cluster(codec, steps), ["--run-dir", "{tmp}/run"], 600, cache)
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
        summary = json.loads((tmp / "run" / "summary.json").read_text())
        tokens = 8 * 16 * 128
        step_s = statistics.median(r["step_s"] for r in records[warmup:])
        results[codec] = {"tokens_per_s": tokens / step_s, "step_s": step_s,
                          "final_loss": statistics.mean(r["loss"] for r in records[-10:]),
                          "codec_used": summary["plan"]["stages"][0]["forward_codec"],
                          "link": summary["links"][0], "predicted_step_s": summary["plan"].get("predicted_step_s")}
    reporter.advance("done")
    base = results["none"]
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["loss_vs_none"] = (r["final_loss"] - base["final_loss"]) / base["final_loss"]
    auto = results["auto"]
    met = (results["int8"]["speedup"] >= TARGET_INT8 and auto["speedup"] >= TARGET_AUTO
           and abs(auto["loss_vs_none"]) <= TARGET_LOSS)
    return {
        "description": "2 nodes, 2 regions, emulated 20 Mbps / 40 ms link, cut pinned in the middle, GPipe with "
                       "16 micro-batches; tokens/s and final loss per codec",
        "config": {"steps": steps, "warmup": warmup, "link": {"bandwidth_mbps": 20, "latency_ms": 40},
                   "bandwidth_method": "agent emulation (hold each message for latency + wire bytes / bandwidth)"},
        "codecs": results,
        "figure": {"name": "speedup over none: int8 / auto", "value": [results["int8"]["speedup"], auto["speedup"]],
                   "target": f"int8 >= {TARGET_INT8}, auto >= {TARGET_AUTO} with loss within {TARGET_LOSS:.0%}"},
        "met": met,
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
