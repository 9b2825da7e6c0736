"""What a job asks the planner for, and the one function that plans it: `hetlaunch plan` and
`hetlaunch up` (its first plan and every re-plan) both go through `plan_for`.

The batch is either a micro-batch count at the profile's micro-batch size, or a global batch
of samples whose micro-batch size (and count, unless fixed) the planner chooses
(launcher/planning/batch_sizes.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hetlaunch.launcher.planning.compression import CompressionConfig
from hetlaunch.launcher.planning.batch_sizes import at_size
from hetlaunch.launcher.planning.device_plans import plan_devices
from hetlaunch.launcher.planning.planner import (PlannerResult, PlanningError, fits_memory, plan, plan_global_batch,
                                                price_pipelines)
from hetlaunch.launcher.planning.profile_file import Profile
from hetlaunch.runtime.registry import (AUTO_DEVICE_SCHEDULE_GAIN, AUTO_MORE_MEMORY_GAIN, AUTO_SCHEDULE, AUTO_SCHEDULES,
                                        DEVICE_SCHEDULE_NAMES)


@dataclass(frozen=True)
class PlanRequest:
    num_microbatches: int  # per step, without a global batch
    schedule: str
    compression: CompressionConfig
    max_pipelines: int | None = None  # None: as many as pay off
    global_batch: int | None = None  # samples per step: the planner chooses the micro-batches
    fixed_microbatches: int | None = None  # with a global batch: the count it must use
    stages: int | None = None  # stages per pipeline; None: the planner decides
    # With `schedule: auto`: why the job cannot run a device schedule (several stages per node), in
    # a few words, for the plan's note; None: the caller's job can (launcher/device_schedule_checks.py
    # `auto_refusal` of the whole YAML, launcher/adapt/replanner.py `request_for`), and auto prices
    # them where its plan is one pipeline.
    device_schedules_refused: str | None = "not offered by the caller"

    @classmethod
    def for_train(cls, train, compression: CompressionConfig,
                  device_schedules_refused: str | None = "not offered by the caller") -> PlanRequest:
        """The request of a YAML's `train:` section (launcher/train_config.py) and `compression:`."""
        return cls(num_microbatches=train.num_microbatches, schedule=train.schedule, compression=compression,
                   max_pipelines=None if train.max_pipelines == "auto" else train.max_pipelines,
                   global_batch=train.global_batch, fixed_microbatches=train.fixed_microbatches,
                   device_schedules_refused=device_schedules_refused)


def plan_for(profile: Profile, request: PlanRequest) -> PlannerResult:
    """The planner's best plan for `request` on `profile`; PlanningError if none fits. With
    `schedule: auto`, the cut is searched under AUTO_SCHEDULES[0] (1F1B) and then priced, by
    simulation, under each other candidate; the fastest whose memory fits every stage is kept,
    where a candidate holding more micro-batches than the one kept so far (a later one) must be
    faster by AUTO_MORE_MEMORY_GAIN. Then, where the job can run them and a pipeline of that plan
    has 2 nodes or more, each of DEVICE_SCHEDULE_NAMES is planned with as many pipelines at most
    (launcher/planning/device_plans.py, which keeps only cuts that fit each node's memory) and the
    fastest is taken if it beats the one-stage-per-node plan by AUTO_DEVICE_SCHEDULE_GAIN. The note names each candidate that fits
    with the tokens/s it was priced at, and each device schedule's price or why it was not priced."""
    if request.schedule != AUTO_SCHEDULE:
        return _plan_for(profile, request)
    first, *others = AUTO_SCHEDULES
    best = _plan_for(profile, replace(request, schedule=first))
    searched, priced = best, [(first, best.tokens_per_s)]
    for schedule in others:
        chains = [([s.node for s in p.cost.stages], [(s.layer_start, s.layer_end) for s in p.cost.stages],
                   p.cost.num_microbatches) for p in searched.pipelines]
        try:
            other = price_pipelines(at_size(profile, searched.micro_batch_size), chains, schedule, request.compression)
        except PlanningError:
            continue
        if not fits_memory(other):
            continue
        priced.append((schedule, other.tokens_per_s))
        if other.tokens_per_s >= best.tokens_per_s * AUTO_MORE_MEMORY_GAIN:
            best = replace(searched, pipelines=other.pipelines, sync=other.sync, step_s=other.step_s,
                           tokens_per_s=other.tokens_per_s, schedule=schedule, contention=other.contention)
    note = ", ".join(f"{s} {t:,.0f}" for s, t in priced)
    gain = f"; a schedule holding more micro-batches is kept for {AUTO_MORE_MEMORY_GAIN - 1:.0%} more or better"
    choice = f"auto: the cut searched under {first}, priced tokens/s {note}{gain}"
    started = time.perf_counter()
    chosen, devices = _device_schedules(profile, request, best)
    planning_s = best.planning_s + time.perf_counter() - started  # the device schedules' plans too
    if chosen is None:
        return replace(best, schedule_choice=f"{choice}; {devices}", planning_s=planning_s)
    return replace(chosen, schedule_choice=f"{choice}; {devices}; {chosen.schedule} chosen ({chosen.schedule_choice}): "
                                           f"rebalancing is off under it", planning_s=planning_s)


def _device_schedules(profile: Profile, request: PlanRequest,
                      best: PlannerResult) -> tuple[PlannerResult | None, str]:
    """The device schedule plan `auto` takes over `best` (its one-stage-per-node choice), or None;
    and the note's words on each device schedule: its tokens/s, or why it was not priced."""
    names = " and ".join(DEVICE_SCHEDULE_NAMES)
    refused = device_refusal(request, best)
    if refused is not None:
        return None, f"{names} not considered: {refused}"
    planned, words = [], []
    for schedule in DEVICE_SCHEDULE_NAMES:
        try:  # as many pipelines as the one-stage-per-node plan found worth it, at most
            result = plan_devices(profile, request.num_microbatches, schedule, len(best.pipelines), request.compression)
        except PlanningError:  # too few layers, micro-batches that do not suit it, no cut that fits memory
            words.append(f"{schedule} no plan")
            continue
        if any(len({s.node for s in p.cost.stages}) < 2 for p in result.pipelines):  # a 1F1B chain of one node
            words.append(f"{schedule} on one node only")
            continue
        planned.append(result)
        words.append(f"{schedule} {result.tokens_per_s:,.0f}")
    note = (f"several stages per node priced tokens/s {', '.join(words)}; taken for "
            f"{AUTO_DEVICE_SCHEDULE_GAIN - 1:.0%} more or better")
    fastest = max(planned, key=lambda r: r.tokens_per_s, default=None)
    if fastest is None or fastest.tokens_per_s < best.tokens_per_s * AUTO_DEVICE_SCHEDULE_GAIN:
        return None, note
    return fastest, note


def device_refusal(request: PlanRequest, best: PlannerResult) -> str | None:
    """Why `auto` does not price the device schedules over `best`, its one-stage-per-node plan for
    `request` (in a few words), or None where it does."""
    if request.device_schedules_refused is not None:
        return request.device_schedules_refused
    if request.global_batch is not None:
        return "a global batch"
    if request.stages is not None:
        return "a stage count given"
    policy = request.compression
    if policy.boundaries or {policy.intra_region, policy.cross_region} - {"auto", "none"}:
        return "a pinned codec"
    if all(len(p.cost.stages) < 2 for p in best.pipelines):
        return "one node" if len(best.pipelines) == 1 else f"{len(best.pipelines)} pipelines of one node each"
    return None


def _plan_for(profile: Profile, request: PlanRequest) -> PlannerResult:
    if request.schedule in DEVICE_SCHEDULE_NAMES:  # several stages per node: M as given
        if request.global_batch is not None or request.stages is not None:
            raise PlanningError(f"{request.schedule} plans at a given micro-batch count and its own stage count: "
                                f"no global batch or stage count")
        # max_pipelines auto is one pipeline here: several are planned only where a number asks for them
        return plan_devices(profile, request.num_microbatches, request.schedule, request.max_pipelines or 1,
                            request.compression)
    pipelines = len(profile.nodes) if request.max_pipelines is None else request.max_pipelines
    if request.global_batch is None:
        return plan(profile, request.num_microbatches, request.schedule, max_pipelines=pipelines,
                    stages=request.stages, compression=request.compression)
    return plan_global_batch(profile, request.global_batch, request.schedule, max_pipelines=pipelines,
                             stages=request.stages, compression=request.compression,
                             num_microbatches=request.fixed_microbatches)
