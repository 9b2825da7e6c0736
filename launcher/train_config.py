"""The train, checkpoint and observe sections of the cluster YAML (launcher/cluster_config.py holds the rest)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from hetlaunch.launcher.config_errors import FieldError, show
from hetlaunch.launcher.config_types import MAX_COUNT, MAX_STEPS, Name, Seed, Strict, YamlFloat, home_path
from hetlaunch.runtime.registry import (AUTO_SCHEDULE, DEFAULT_LINK_ROUNDING, DEFAULT_SCHEDULE, DEVICE_SCHEDULE_NAMES,
                                        MAX_MICROBATCHES, SCHEDULE_NAMES)


def _auto_or_positive(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_STEPS):
        return value
    raise ValueError(f"must be auto or an integer from 1 to {MAX_STEPS:,} (got {show(value)})")


MAX_WATCHDOG_S = 10**7  # about 4 months: a longer wait is `off` (and a timeout that large overflows)


def _watchdog(value: Any) -> Any:
    if value in ("auto", "off") or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                    and 5 <= value <= MAX_WATCHDOG_S):
        return value
    raise ValueError(f"must be auto, off or a number of seconds from 5 to {MAX_WATCHDOG_S:,} (got {show(value)})")


def _rebalance(value: Any) -> Any:
    if isinstance(value, bool):  # the older spelling
        return "auto" if value else "off"
    return value


def _every(value: Any) -> Any:
    return _auto_or_positive(value)


class OuterConfig(Strict):
    """Islands with outer steps (DiLoCo, runtime/outer_sync.py). The islands train apart and meet
    every `every` steps, so the run is not step-for-step the synchronous one (README: Islands)."""

    # by_region: one island per region; or lists of node names, every node in exactly one.
    islands: Literal["by_region"] | list[list[Name]] = "by_region"
    # Inner steps between outer steps; auto: the smallest H whose exchange costs <= 5% of H steps
    # (the planner's; 50 on a plan it did not price).
    every: Annotated[int | Literal["auto"], BeforeValidator(_every)] = "auto"
    lr: YamlFloat = Field(0.7, gt=0)         # outer Nesterov SGD, DiLoCo's defaults
    momentum: YamlFloat = Field(0.9, ge=0, lt=1)
    codec: Literal["none", "bf16", "int8", "int4"] = "int8"  # for the exchanged deltas, with error feedback
    fragments: int = Field(1, ge=1, le=1024)  # streaming: layer fragments exchanged in turn, spread over H
    delay: int = Field(0, ge=0, le=MAX_STEPS)  # inner steps an exchange overlaps before it is applied
    alpha: YamlFloat = Field(0.0, ge=0, lt=1)  # with a delay: the local parameters' weight when applying

    @model_validator(mode="after")
    def _consistent(self) -> OuterConfig:
        if isinstance(self.islands, list):
            if not self.islands or any(not island for island in self.islands):
                raise FieldError(("islands",), "list at least one island, each with at least one node")
            seen: set[str] = set()
            for i, island in enumerate(self.islands):
                for name in island:
                    if name in seen:
                        raise FieldError(("islands", i), f"node {name!r} is in two islands")
                    seen.add(name)
        if self.every != "auto" and self.delay >= self.every:
            raise FieldError(("delay",), f"{self.delay} must be below every ({self.every})")
        if self.alpha > 0 and self.delay == 0:
            raise FieldError(("alpha",), "mixes the local weights into an exchange applied late: only with a delay")
        return self

    def too_many_fragments(self, layers: int) -> str | None:
        """Why `fragments` cannot split a model of `layers` stage layers, or None: validate asks where
        the YAML sizes the model (or pins size it), the planner where only the profile does."""
        if self.fragments <= layers:
            return None
        return f"{self.fragments} fragments of a model of {layers} stage layers: at most one fragment a layer"


class TrainConfig(Strict):
    steps: int = Field(300, ge=1, le=MAX_STEPS)  # optimizer steps
    micro_batch_size: int = Field(8, ge=1, le=MAX_COUNT)  # samples per micro-batch
    num_microbatches: int = Field(4, ge=1, le=MAX_MICROBATCHES)  # micro-batches per step (global batch = the product)
    # Samples per step. Set, the planner chooses the micro-batch size (micro_batch_size is then the
    # largest it tries and the size profiled) and the count; a num_microbatches given too fixes the count.
    global_batch: int | None = Field(None, ge=1, le=1 << 24)
    # pipeline schedule (runtime/registry.py); auto: the planner's choice (launcher/planning/request.py);
    # interleaved-1f1b and zb-v: several stages per node, one pipeline (launcher/device_schedule_checks.py)
    schedule: Literal[(*SCHEDULE_NAMES, *DEVICE_SCHEDULE_NAMES, AUTO_SCHEDULE)] = DEFAULT_SCHEDULE
    # bf16/fp16: autocast over fp32 master weights and optimizer state; activations cross links in
    # the compute dtype; fp16 adds a loss scale kept the same on every stage.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # bf16: activations and gradients cross links rounded to nearest (0.1% above fp32's loss over 5
    # seeds of bench/precision.py) or stochastically (unbiased, but noisier: 1.6% above);
    # runtime/wire_rounding.py. fp16 always rounds to nearest
    link_rounding: Literal["nearest", "stochastic"] = DEFAULT_LINK_ROUNDING
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: YamlFloat = Field(3.0e-3, gt=0, le=1e3)  # peak learning rate (1e308 trained to NaN at once without a word)
    momentum: YamlFloat = Field(0.9, ge=0, lt=1)  # sgd only
    weight_decay: YamlFloat = Field(0.0, ge=0)  # decoupled (AdamW) or L2 (SGD); only on weights of >= 2 dimensions
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up, down to lr * min_lr_ratio by the end of the run
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS)  # linear warm-up from lr / warmup_steps
    min_lr_ratio: YamlFloat = Field(0.1, ge=0, le=1)
    grad_clip: YamlFloat = Field(0.0, ge=0)  # max norm of the whole model's gradient (all stages, all pipelines); 0: off
    eval_every: int = Field(0, ge=0, le=MAX_STEPS)  # held-out loss every this many steps and after the last; 0: never
    eval_microbatches: int = Field(4, ge=1, le=MAX_MICROBATCHES)  # micro-batches (of micro_batch_size) per evaluation
    # Run the evaluation due after a step inside the next step's idle time (runtime/bubble_fill.py),
    # where the plan's simulation predicts it; false: after the step, training stopped.
    eval_in_bubbles: bool = True
    seed: Seed = 0  # parameter-init seed
    # Save parameters and AdamW state every this many steps (and after the last) under
    # <run dir>/checkpoints/ (or checkpoint.dir): what a restart after a lost node resumes from.
    # 0: never (a lost node then restarts the job from step 0, unless a replica stands in).
    checkpoint_every: int = Field(50, ge=0, le=MAX_STEPS)
    # When a node stays off its calibrated speed (launcher/adapt/straggler.py): auto (true) moves layers
    # live in the running stages or restarts on a new plan at the next checkpoint, whichever pays
    # more; live / restart: only that way; off (false): only report it (events.jsonl `straggler`).
    rebalance: Annotated[Literal["auto", "live", "restart", "off"], BeforeValidator(_rebalance)] = "auto"
    max_restarts: int = Field(3, ge=0, le=MAX_COUNT)  # generations restarted after lost nodes before the job gives up
    # The progress watchdog (runtime/stage_watchdog.py): a stage with no step for this many seconds
    # is stalled (a frozen worker, a hung collective, a cut link): its agent kills the worker and the
    # job recovers as from a lost node. auto: max(10 x the plan's step, 60 s); off: never.
    watchdog_s: Annotated[YamlFloat | Literal["auto", "off"], BeforeValidator(_watchdog)] = "auto"
    # Data-parallel pipelines the planner may use (each its own chain of nodes and cut): auto = as many as pay off
    max_pipelines: Annotated[int | Literal["auto"], BeforeValidator(_auto_or_positive)] = "auto"
    # With pinned layers over several pipelines: each pipeline's micro-batches per step (default: as planned)
    pipeline_microbatches: list[int] | None = Field(None, min_length=1, max_length=MAX_MICROBATCHES)
    # Islands that meet every H steps (DiLoCo) instead of syncing every step; unset: synchronous.
    outer: OuterConfig | None = None

    @model_validator(mode="after")
    def _shares(self) -> TrainConfig:
        given = self.model_fields_set
        if self.global_batch is not None and -(-self.global_batch // self.micro_batch_size) > MAX_MICROBATCHES:
            raise FieldError(("global_batch",), f"{self.global_batch} samples at micro_batch_size "
                                                f"{self.micro_batch_size} (the largest the planner tries) are more "
                                                f"than the {MAX_MICROBATCHES:,} micro-batches a step may have: "
                                                f"raise micro_batch_size")
        if self.global_batch is not None and "num_microbatches" in given:
            if self.global_batch % self.num_microbatches:
                raise FieldError(("num_microbatches",), f"{self.num_microbatches} micro-batches do not divide "
                                                        f"global_batch ({self.global_batch})")
            if "micro_batch_size" in given and self.micro_batch_size * self.num_microbatches != self.global_batch:
                raise FieldError(("global_batch",), f"{self.global_batch} is not micro_batch_size x num_microbatches "
                                                    f"({self.micro_batch_size} x {self.num_microbatches}); give two")
        if self.pipeline_microbatches is not None:
            if self.global_batch is not None and "num_microbatches" not in given:
                raise FieldError(("pipeline_microbatches",), "with global_batch, give num_microbatches too")
            if min(self.pipeline_microbatches) < 1 or sum(self.pipeline_microbatches) != self.num_microbatches:
                raise FieldError(("pipeline_microbatches",), f"{self.pipeline_microbatches} must be >= 1 each and "
                                                             f"sum to num_microbatches ({self.num_microbatches})")
        return self

    @property
    def fixed_microbatches(self) -> int | None:
        """The micro-batch count the planner must use; None when it chooses (global_batch alone)."""
        if self.global_batch is not None and "num_microbatches" not in self.model_fields_set:
            return None
        return self.num_microbatches

    @property
    def profile_size(self) -> int:
        """The micro-batch size nodes are profiled at: the largest the planner tries."""
        if self.global_batch is not None and "num_microbatches" in self.model_fields_set:
            return self.global_batch // self.num_microbatches
        return self.micro_batch_size

    def batch_shape(self) -> tuple[int, int]:
        """(micro-batch size, micro-batches per step) of a plan not chosen by the planner: the
        given ones, or with global_batch alone its largest divisor up to micro_batch_size."""
        if self.global_batch is None:
            return self.micro_batch_size, self.num_microbatches
        if self.fixed_microbatches is not None:
            return self.profile_size, self.fixed_microbatches
        size = max(b for b in range(1, min(self.global_batch, self.micro_batch_size) + 1) if self.global_batch % b == 0)
        return size, self.global_batch // size


class ObserveConfig(Strict):
    # Record a timeline (runs/<id>/trace.json, launcher/timeline.py) of every this many steps; 0: never.
    trace_every: int = Field(25, ge=0, le=MAX_STEPS)
    # Scalars for TensorBoard in runs/<id>/tensorboard/ (launcher/observers.py; the tensorboard extra).
    tensorboard: bool = False


def _checkpoint_dir(value: str | None) -> str | None:
    """A directory of checkpoints (made if missing): not a file, a device or the file system's root,
    which would get a step directory for every checkpoint. Checked here, on the host that validates
    (the coordinator's when `up` runs); remote stages write there too only on a shared file system."""
    if value is None:
        return value
    home = home_path(value)  # `~/ck` is the user's home: a folder named ~ made where `up` ran was resumed from nowhere else
    try:  # a folder this user may not search, a symlink loop (RuntimeError) or a name too long: one line, not a traceback
        path = home.resolve()
        if path == Path(path.anchor):
            raise ValueError(f"{value!r} is the file system's root: name a directory for this job's checkpoints")
        if path.exists() and not path.is_dir():
            raise ValueError(f"{value!r} exists and is not a directory")
    except OSError as err:
        raise ValueError(f"{value!r}: {err.strerror or err}") from None
    except RuntimeError as err:
        raise ValueError(f"{value!r}: {err}") from None
    return str(home)


class CheckpointConfig(Strict):
    # Where checkpoints go; null = <run dir>/checkpoints. A path every node can write (a shared
    # file system) when some agents are remote: each stage writes its part there itself.
    dir: Annotated[str | None, AfterValidator(_checkpoint_dir)] = Field(None, min_length=1)
    keep: int = Field(2, ge=1, le=MAX_COUNT)  # committed checkpoints kept; older ones are deleted
