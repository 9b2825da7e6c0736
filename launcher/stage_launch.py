"""Turn a plan into the RunStage commands of one generation: ranks, links, sync groups, restore."""

from __future__ import annotations

from pathlib import Path

from hetlaunch.launcher.checkpoint_book import Restore
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.topology import Placement, Topology
from hetlaunch.launcher.session import RENDEZVOUS_TIMEOUT_S, ClusterSession
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.bubble_fill import FillReport, fill_bubbles
from hetlaunch.runtime.schedules import schedule_for
from hetlaunch.runtime.wire import codec_wire_id, model_spec_to_proto, schedule_wire_id


def launch(session: ClusterSession, plan: Plan, spec, restore: Restore, checkpoint_root: Path,
           boundary_bytes: list[int] | None = None, eval_before_start: bool = False) -> dict[tuple[str, int], Placement]:
    """Push every stage its RunStage on a fresh data-plane generation, starting from `restore`.
    `boundary_bytes[i]` (the profile's output of layer i) bounds what a link after layer i accepts.
    `eval_before_start`: the held-out loss due after the step before `restore` is measured first.
    Returns the checkpoint writers (Topology.checkpoint_writers: the first pipeline's stages)."""
    cluster = session.cluster
    topology = Topology.of(plan)
    # A RunStage goes to a node, whose agent runs one stage worker: refuse a node with two here.
    topology.by_node("launching a generation (an agent runs one stage worker)")
    backend = session.backend_for(list(topology.nodes))
    t = cluster.train
    d = cluster.data
    data = pb.DataSpec(path=str(Path(d.path).resolve()) if d.path else "", seed=d.seed, format=d.format, dtype=d.dtype,
                       eval_fraction=d.eval_fraction)
    model = model_spec_to_proto(spec)
    world = len(topology.placements)
    several = len(topology.pipelines) > 1
    shared = data_parallel(cluster, plan) if several else None
    generation = session.begin_generation()
    # With several pipelines a failing stage snapshots its layers: another pipeline may hold the lost ones.
    snapshot_root = checkpoint_root / f"replica-g{generation}" if several else None
    layout = layout_of(plan)
    offset = 0
    for p, (stages, share) in enumerate(zip(topology.pipelines, plan.pipeline_microbatches)):
        fills = eval_fills([q.source for q in stages], plan.schedule, share, t.eval_microbatches)[0] \
            if t.eval_every and t.eval_in_bubbles else [""] * len(stages)
        train = pb.TrainSpec(steps=t.steps, micro_batch_size=plan.micro_batch_size, num_microbatches=share,
                             schedule=schedule_wire_id(plan.schedule), lr=t.lr, weight_decay=t.weight_decay, seed=t.seed,
                             checkpoint_dir=str(checkpoint_root) if t.checkpoint_every else "",
                             checkpoint_every=t.checkpoint_every,
                             save_part=p == 0, start_step=restore.step, optimizer=t.optimizer, momentum=t.momentum,
                             lr_schedule=t.lr_schedule, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio,
                             grad_clip=t.grad_clip, eval_every=t.eval_every, eval_microbatches=t.eval_microbatches,
                             eval_before_start=eval_before_start,
                             precision=t.precision, link_rounding=t.link_rounding, trace_every=cluster.observe.trace_every,
                             **watchdog_bounds(t.watchdog_s, plan.predicted_step_s, _outer_wait_s(plan)))
        for placement in stages:
            node = cluster.node(placement.node)
            spec_msg = stage_spec(session, topology, placement, boundary_bytes)
            spec_msg.eval_fill = fills[placement.stage]
            command = pb.RunStage(model=model, data=data, train=train, stage=spec_msg,
                                  rendezvous=session.rendezvous(placement.rank, world, backend, placement.node),
                                  layout=layout)
            # A remote stage's parts must outlive its host: without a shared dir its agent uploads them.
            command.train.upload_parts = node.launch != "local" and not cluster.checkpoint.dir
            if snapshot_root is not None:
                command.train.snapshot_dir = str(snapshot_root / placement.node)
            if restore.directory is not None:
                command.restore.checkpoint_dir = str(restore.directory)
            if shared is not None:
                command.data_parallel.CopyFrom(shared)
                command.data_parallel.pipeline_index = p
                command.data_parallel.microbatch_offset = offset
                if plan.islands:
                    island = plan.islands[p]
                    command.data_parallel.island_index = island
                    command.data_parallel.island_microbatches = plan.island_microbatches()[island]
            session.state.send(placement.node, pb.Command(run_stage=command))
        offset += share
    return topology.checkpoint_writers()


def eval_fills(stages, schedule: str, num_microbatches: int, num_eval: int) -> tuple[list[str], FillReport]:
    """Each stage's actions for a step that also evaluates (StageSpec.eval_fill), placed in the idle
    time of the plan's simulation: the stages' priced forward and backward, links and latencies, or
    unit compute and free links where the plan has no prediction (pinned, even)."""
    S = len(stages)
    priced = all(s.compute_s is not None for s in stages) and \
        all(s.link_s is not None and s.latency_s is not None for s in stages[:-1])
    forward, backward = zip(*(s.forward_backward_s() if priced else (1 / 3, 2 / 3) for s in stages))
    actions = [schedule_for(schedule, j, S, num_microbatches, s.window) for j, s in enumerate(stages)]
    lists, report = fill_bubbles(actions, num_eval, list(forward), list(backward),
                                 [s.link_s if priced else 0.0 for s in stages[:-1]],
                                 [s.latency_s if priced else 0.0 for s in stages[:-1]])
    return [" ".join(a.label for a in stage_actions) for stage_actions in lists], report


def eval_fill_event(plan: Plan, num_eval: int) -> dict:
    """What evaluation in the bubbles is predicted to cost the first pipeline's step (events.jsonl
    `eval_fill`): the simulated step without and with the held-out forwards where they were
    placed, the same step followed by evaluation through the pipeline, and the shares filled."""
    stages = [q.source for q in Topology.of(plan).pipelines[0]]
    _, report = eval_fills(stages, plan.schedule, plan.pipeline_microbatches[0], num_eval)
    return {"step_s": round(report.step_s, 6), "step_with_eval_s": round(report.step_with_eval_s, 6),
            "after_step_s": round(report.after_step_s, 6),
            "idle_filled": round(report.filled_fraction, 4),
            "eval_in_idle": round(report.filled_s / report.eval_s, 4) if report.eval_s else 0.0,
            "unit_costs": any(s.compute_s is None for s in stages)}


WATCHDOG_STEPS = 10  # train.watchdog_s auto: this many predicted steps without one...
WATCHDOG_MIN_S = 60.0  # ... and never less (a checkpoint write or a live move holds the step loop)
FIRST_STEP_EXTRA_S = RENDEZVOUS_TIMEOUT_S + 60.0  # before the first step: the rendezvous and the restore


def _outer_wait_s(plan: Plan) -> float:
    """How long a step may wait on an outer step with islands: the exchange, and the slowest island
    reaching it (OUTER_WAIT_FACTOR x the exchange as priced, whatever the shares promised)."""
    if plan.outer is None or plan.outer.exchange_s is None:
        return OUTER_WAIT_MIN_S if plan.outer is not None else 0.0
    return max(OUTER_WAIT_MIN_S, OUTER_WAIT_FACTOR * plan.outer.exchange_s)


OUTER_WAIT_FACTOR = 3.0
OUTER_WAIT_MIN_S = 60.0  # an unpriced exchange (pinned layers, nothing measured)


def watchdog_bounds(setting, predicted_step_s: float | None, outer_wait_s: float = 0.0) -> dict[str, float]:
    """TrainSpec's watchdog_s and first_step_watchdog_s for train.watchdog_s (both 0: off). With
    islands, auto adds the time a step may wait on an outer step (no step is reported meanwhile)."""
    if setting == "off":
        return {"watchdog_s": 0.0, "first_step_watchdog_s": 0.0}
    bound = (max(WATCHDOG_STEPS * (predicted_step_s or 0.0), WATCHDOG_MIN_S) + outer_wait_s if setting == "auto"
             else float(setting))
    return {"watchdog_s": bound, "first_step_watchdog_s": bound + FIRST_STEP_EXTRA_S}


def layout_of(plan: Plan) -> list[pb.StagePlace]:
    """Every rank's pipeline and layer range."""
    return [pb.StagePlace(rank=q.rank, pipeline=q.pipeline, layer_start=q.layer_start, layer_end=q.layer_end,
                          region=getattr(q.source, "region", "") or "", node=q.node)
            for q in Topology.of(plan).placements]


def stage_spec(session: ClusterSession, topology: Topology, placement: Placement,
               boundary_bytes: list[int] | None) -> pb.StageSpec:
    """The StageSpec of one placement: its layers, device, emulation and the links to its
    neighbours in its pipeline (at their ranks)."""
    cluster, stage, j = session.cluster, placement.source, placement.stage
    stages = topology.pipelines[placement.pipeline]
    node = cluster.node(stage.node)
    spec = pb.StageSpec(stage_index=j, num_stages=len(stages), layer_start=stage.layer_start,
                        layer_end=stage.layer_end, device=session.device_of(stage.node),
                        threads=session.threads_of(stage.node),
                        emulate=pb.Emulation(speed=node.emulate.speed,
                                             speed_changes=[pb.SpeedChange(at_step=c.at_step, speed=c.speed)
                                                            for c in node.emulate.speed_changes],
                                             memory_gb=node.emulate.memory_gb or 0.0),
                        memory_fraction=node.memory_fraction or 0.0, window=stage.window)
    if j > 0:
        prev = stages[j - 1]
        spec.prev.CopyFrom(_link_spec(cluster, prev.source, stage, prev.rank, boundary_bytes))
    if j < len(stages) - 1:
        after = stages[j + 1]
        spec.next.CopyFrom(_link_spec(cluster, stage, after.source, after.rank, boundary_bytes))
    return spec


def data_parallel(cluster, plan: Plan) -> pb.DataParallel:
    """What every stage of a several-pipeline plan shares: the global batch and all sync groups."""
    topology = Topology.of(plan)
    message = pb.DataParallel(global_microbatches=plan.num_microbatches,
                              pipeline_sizes=[len(stages) for stages in topology.pipelines],
                              pipeline_microbatches=list(plan.pipeline_microbatches))
    for group in plan.sync_plans():
        message.sync_groups.append(_group_spec(cluster, topology, group))
    if plan.outer is not None:
        o = plan.outer
        for members in plan.island_members():
            message.islands.add(ranks=[q.rank for p in members for q in topology.pipelines[p]])
        message.outer.CopyFrom(pb.OuterSpec(every=o.every, lr=o.lr, momentum=o.momentum, fragments=o.fragments,
                                            delay=o.delay, alpha=o.alpha,
                                            groups=[_group_spec(cluster, topology, g) for g in plan.outer_sync_plans()]))
    return message


def _group_spec(cluster, topology: Topology | None, group, rank_of=None) -> pb.SyncGroupSpec:
    """A sync group's wire form. Its ranks: each holder node's stage holding these layers, or
    `rank_of(node)` where a node is one rank whatever it holds (several stages per node)."""
    bw, lat = _slowest_emulated_link(cluster, group.nodes)
    rank_of = rank_of or (lambda name: topology.holder(name, group.layer_start).rank)
    regions: list[int] = []
    if getattr(group, "hierarchical", False):
        order: dict[str, int] = {}  # region groups numbered by first holder, in pipeline order
        regions = [order.setdefault(cluster.node(name).region, len(order)) for name in group.nodes]
    return pb.SyncGroupSpec(layer_start=group.layer_start, layer_end=group.layer_end,
                            ranks=[rank_of(name) for name in group.nodes],
                            codec=codec_wire_id(group.codec), emulate_bandwidth_mbps=bw, emulate_latency_ms=lat,
                            region_of=regions)


def _slowest_emulated_link(cluster, nodes: tuple[str, ...]) -> tuple[float, float]:
    """A sync group runs at its slowest link: the lowest emulated bandwidth, the highest latency."""
    pairs = [cluster.emulated_link(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    limited = [bw for bw, _ in pairs if bw > 0]
    return (min(limited) if limited else 0.0), max((lat for _, lat in pairs), default=0.0)


def _link_spec(cluster, up, down, peer_rank: int, boundary_bytes: list[int] | None) -> pb.LinkSpec:
    """The boundary between stages `up` and `down` of one pipeline, as seen from one side. A
    message (activation or gradient, fp32 at most) may be twice the profiled boundary, plus 1 MiB:
    room for a profile taken at another precision, never room for an arbitrary allocation."""
    bw, lat = cluster.emulated_link(up.node, down.node)
    limit = 0
    if boundary_bytes is not None and up.layer_end - 1 < len(boundary_bytes):
        limit = 2 * boundary_bytes[up.layer_end - 1] + 2**20
    return pb.LinkSpec(peer_rank=peer_rank, forward_codec=codec_wire_id(up.forward_codec),
                       backward_codec=codec_wire_id(up.backward_codec),
                       emulate_bandwidth_mbps=bw, emulate_latency_ms=lat, max_message_bytes=limit,
                       sealed=cluster.seals(up.node, down.node),
                       bandwidth_changes=[pb.BandwidthChange(at_step=s, bandwidth_mbps=mbps)
                                          for s, mbps in cluster.emulated_bandwidth_changes(up.node, down.node)])
