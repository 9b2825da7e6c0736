"""What measuring a stage's memory costs (runtime/memory_limit.py): on CPU a saved-tensor hook runs
for every tensor autograd saves, every forward of a counted step.

One process, one intra-op thread, the tiny preset as one stage (1F1B, 4 micro-batches of 8),
three executors built alike and stepped in turn, step after step (the order rotates, so a busy
moment falls on each): "none" without a StageMemory, "every" counting every step (what a
stage under a memory limit does: the hook and the used-bytes walk after the step), "sampled"
the default without a limit (the first 2 steps and every 25th). Figures:

* every-step ratio: the median over rounds of every's step ÷ none's step in the same round;
* pack body: the saved tensors of a step × one call of the counting pack function, timed alone,
  ÷ none's median step: the counting code itself. The rest of the every-step overhead is
  autograd calling into Python for each saved tensor (pack, and unpack in the backward) and
  the used-bytes walk after the step (timed alone too);
* sampled cost: the every-step overhead × the share of steps a long run counts (1/25): the
  headline, target <= 1% of a step. The sampled side's ratio to none, measured the same way,
  is given beside it (expected 1 within the noise).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from _harness import NullReporter, Reporter

from hetlaunch.runtime.executor import StageExecutor
from hetlaunch.runtime.memory_limit import COUNT_EVERY, StageMemory
from hetlaunch.runtime.model import build_model_range
from hetlaunch.runtime.model_spec import ModelSpec, preset
from hetlaunch.runtime.schedules import schedule_for

MICROBATCHES, MICRO_BATCH_SIZE = 4, 8
TARGET = 0.01
CPU = torch.device("cpu")


def _executor(memory: StageMemory | None) -> StageExecutor:
    bundle = build_model_range(ModelSpec(gpt=preset("tiny")), 0, 6, seed=0)
    return StageExecutor(bundle.layers, bundle.loss_fn, is_first=True, is_last=True, device=CPU, memory=memory)


def _hook_seconds(executor: StageExecutor, actions, data) -> tuple[int, float]:
    """(tensors saved per step, seconds of one pack call on them), the pack of StageMemory.forward."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        executor.train_step(actions, data, MICROBATCHES)
    memory = StageMemory(0, CPU)
    memory.attach(executor.module)
    memory.begin_step(0)
    hooks, installed = torch.autograd.graph.saved_tensors_hooks, []

    class Seen(hooks):  # StageMemory.forward installs its pack function through this name: keep it
        def __init__(self, pack, unpack):
            installed.append(pack)
            super().__init__(pack, unpack)

    best = float("inf")
    torch.autograd.graph.saved_tensors_hooks = Seen
    try:
        for _ in range(20):
            with memory.forward(0):  # pack each saved tensor as autograd would
                start = time.perf_counter()
                for t in saved:
                    installed[-1](t)
                best = min(best, time.perf_counter() - start)
            memory.backward_done(0)
    finally:
        torch.autograd.graph.saved_tensors_hooks = hooks
    return len(saved), best / len(saved)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(quick: bool, reporter: Reporter | None = None) -> dict:
    reporter = reporter or NullReporter()
    torch.set_num_threads(1)
    rounds, warmup = (60, 3) if quick else (300, 5)
    sides = {"none": _executor(None), "every": _executor(StageMemory(2**40, CPU, "a limit never reached")),
             "sampled": _executor(StageMemory(0, CPU))}
    actions = schedule_for("1f1b", 0, 1, MICROBATCHES)
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 256, (MICRO_BATCH_SIZE, 64), generator=generator),
             torch.randint(0, 256, (MICRO_BATCH_SIZE, 64), generator=generator)) for _ in range(MICROBATCHES)]
    reporter.total(rounds + warmup + 1)
    steps: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for r in range(warmup + rounds):
        reporter.advance(f"round {r + 1}")
        for name in order[r % 3:] + order[:r % 3]:
            start = time.perf_counter()
            sides[name].train_step(actions, data, MICROBATCHES)
            if r >= warmup:
                steps[name].append(time.perf_counter() - start)
    reporter.advance("one pack call, timed alone")
    saved, per_call = _hook_seconds(_executor(None), actions, data)
    every = sides["every"]
    walk = min(_timed(lambda: every.memory.used_bytes(every.module, every.optimizer)) for _ in range(20))
    none_median = statistics.median(steps["none"])
    every_ratio = statistics.median(e / n for e, n in zip(steps["every"], steps["none"]))
    sampled = (every_ratio - 1) / COUNT_EVERY
    return {
        "description": "tiny preset, one stage, 1F1B 4x8; saved-tensor counting every step, sampled, or none",
        "config": {"rounds": rounds, "warmup": warmup, "microbatches": MICROBATCHES,
                   "micro_batch_size": MICRO_BATCH_SIZE, "count_every": COUNT_EVERY, "threads": 1},
        "figure": {"name": "sampled counting's cost, fraction of a step", "value": sampled,
                   "target": f"<= {TARGET}"},
        "met": sampled <= TARGET,
        "step_ms": {name: statistics.median(v) * 1e3 for name, v in steps.items()},
        "every_step_ratio": every_ratio,
        "sampled_step_ratio": statistics.median(s / n for s, n in zip(steps["sampled"], steps["none"])),
        "saved_tensors_per_step": saved,
        "pack_call_us": per_call * 1e6,
        "pack_body_fraction": saved * per_call / none_median,
        "used_bytes_walk_fraction": walk / none_median,
        "measured": {name: [round(s, 6) for s in v] for name, v in steps.items()},
    }


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in run("--quick" in sys.argv).items() if k != "measured"}, indent=2))
