"""How much memory a stage needs for k of L layers, against a whole-model build.

The model is an entrypoint in the LayeredModel form (tests/user_model.py make_layered_mlp_lm):
L = 24 layers, ~1 GB of fp32 weights (22 residual MLP blocks between an embedding and a head).
Each measurement is a fresh process: it resets the kernel's peak-RSS mark, builds the layers
(`build_model_range`, what a stage does; for the whole model the same call over [0, L)), and
reports the peak resident memory above what the process held before. Also the peak of
profiling the model (`profile_layers`, one layer at a time, identical blocks once), and a
one-layer stage of the same model returned whole (the old `(layers, loss_fn)` form, which
builds everything and keeps its slice: what every entrypoint stage did before).

  ratio(k) = peak(stage of k layers) / peak(whole model)     target <= k/L + 0.1
"""

from __future__ import annotations

import json
import subprocess
import sys

from _harness import REPO, BenchError, NullReporter, Reporter

KWARGS = {"vocab_size": 256, "d": 1152, "n_hidden": 22, "seq_len": 16, "hidden_mult": 4}
QUICK_KWARGS = {**KWARGS, "d": 384}

LAYERED = "user_model:make_layered_mlp_lm"
OLD_FORM = "user_model:make_mlp_lm"  # the same model returned whole, as (layers, loss_fn)


def _peak(kwargs: dict, start: int, end: int, entrypoint: str = LAYERED) -> int:
    out = subprocess.run([sys.executable, str(REPO / "tests" / "peak_memory.py"), entrypoint, json.dumps(kwargs),
                          str(start), str(end)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise BenchError(f"measuring layers [{start}, {end}) failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]  # tests/peak_memory.py


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    kwargs = QUICK_KWARGS if quick else KWARGS
    total = kwargs["n_hidden"] + 2
    ks = [1, total // 4, total // 2]
    reporter.total(len(ks) + 3)
    reporter.advance(f"whole model ({total} layers)")
    whole = _peak(kwargs, 0, total)
    stages = []
    for k in ks:
        reporter.advance(f"a stage of {k} layers")
        start = 1  # from the first block on: the stage a small GPU in the middle of the chain gets
        peak = _peak(kwargs, start, start + k)
        stages.append({"layers": k, "peak_bytes": peak, "ratio": peak / whole, "target": k / total + 0.1})
    reporter.advance("profiling the model")
    profiling = _peak(kwargs, -1, -1)
    reporter.advance("a stage of 1 layer, the model returned whole (the old entrypoint form)")
    old_form = _peak(kwargs, 1, 2, OLD_FORM)
    reporter.advance("done")
    worst = max(s["ratio"] - s["target"] for s in stages)
    return {
        "config": {"model": "tests/user_model.py:make_layered_mlp_lm", "kwargs": kwargs, "layers": total},
        "figure": {"name": "stage peak / whole peak, 1 layer", "value": stages[0]["ratio"],
                   "target": f"<= {stages[0]['target']:.3f}"},
        "met": worst <= 0 and profiling / whole <= 0.5,
        "whole_model_peak_bytes": whole,
        "stages": stages,
        "profiling": {"peak_bytes": profiling, "ratio": profiling / whole},
        # What every entrypoint stage cost before LayeredModel, and what the old form still costs.
        "old_form_stage_of_1": {"peak_bytes": old_form, "ratio": old_form / whole},
    }
