"""What one pipeline costs: each stage's priced terms (StageCost) and the pipeline's step
(PipelineCost), as launcher/planning/cost_model.py prices them and plans carry them."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class StageCost:
    node: str
    layer_start: int
    layer_end: int
    compute_s: float     # t_j, per micro-batch (with the codec work of its incoming boundary)
    link_s: float        # c_j of the outgoing link (0 on the last stage)
    latency_s: float     # lat_j of the outgoing link
    memory_bytes: float
    capacity_bytes: float
    codec: str = "none"              # codec of the outgoing link's activations
    link_uncompressed_s: float = 0.0  # c_j had the outgoing link sent raw bytes
    window: int = 0                  # 1F1B: micro-batches in flight when deeper than the schedule's own; 0: its own
    # What the event simulation charges per micro-batch (CostModel.exact): a third of the layers'
    # time forward, two thirds backward, half the boundary's codec work each way; the optimizer once.
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    # A split backward's two parts (zero-bubble schedules), where the node measured them; both 0:
    # not measured, and the simulation takes half the backward each.
    input_grad_s: float = 0.0
    weight_grad_s: float = 0.0


_STAGE_FIELDS = frozenset(f.name for f in fields(StageCost))


def made_stage(**values) -> StageCost:
    """StageCost(**values) with every field given, without the frozen dataclass's __init__ (one
    object.__setattr__ per field): the search makes hundreds of thousands of them, and that
    __init__ was a tenth of planning 256 nodes. Still frozen once made; equal to one built by
    StageCost(...) (tests/planning/test_exact_pricing.py). Fields in their declared order, as
    StageCost(...) sets them (a dict in another order still compares equal but pickles otherwise)."""
    if values.keys() != _STAGE_FIELDS:
        raise TypeError(f"a StageCost needs exactly its fields, got {sorted(values)}")
    stage = object.__new__(StageCost)
    stage.__dict__.update(values)
    return stage


def copied_stage(stage: StageCost, **changes) -> StageCost:
    """dataclasses.replace(stage, **changes), the way made_stage builds one."""
    return made_stage(**{**stage.__dict__, **changes})


@dataclass(frozen=True)
class PipelineCost:
    stages: tuple[StageCost, ...]
    num_microbatches: int
    step_s: float
    bottleneck: str      # "compute on <node>" or "link <a> -> <b>"
    exact: bool = False  # step_s from the event simulation (CostModel.exact), not the closed form
    # Several stages per node: "timed" where the devices' order was built at these stages' costs
    # (launcher/planning/device_plans.py device_lists); "": the schedule's own order.
    device_order: str = ""


def split_costs(stages) -> tuple[list[float] | None, list[float] | None]:
    """The stages' measured (I, W) for the simulation, or (None, None) where a node measured none
    (the simulation then halves each backward)."""
    if all(s.input_grad_s + s.weight_grad_s > 0 for s in stages):
        return [s.input_grad_s for s in stages], [s.weight_grad_s for s in stages]
    return None, None
