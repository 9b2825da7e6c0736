"""The RunStage commands of a generation whose nodes each run several stages (interleaved 1F1B,
ZB-V): one command per node, carrying all its stages as StageSpec.parts.

A node's agent runs one stage worker, which is one data-plane rank: ranks are the nodes in the
order they first appear, pipeline after pipeline (planning/topology.py `device_rank`), not one per
stage. Each part's links name the rank of the node holding the neighbouring stage, which is the
node's own rank where that stage is on the same node (the worker hands the activation over in
memory, runtime/local_link.py). The checkpoint writers are pipeline 0's stages (one part per
stage, planning/topology.py checkpoint_writers).

Several pipelines: each node serves one, and every command carries RunStage.data_parallel as with
one stage per node (launcher/stage_launch.py `data_parallel`), except that a pipeline's size is its
node count and a sync group's ranks are its holders' nodes: a node syncs every layer it holds in
whichever of its stages (runtime/device_stage_command.py).
"""

from __future__ import annotations

from pathlib import Path

from hetlaunch.launcher.checkpoint_book import Restore
from hetlaunch.launcher.planning.device_plans import device_lists
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.topology import Placement, Topology, device_rank
from hetlaunch.launcher.session import ClusterSession
from hetlaunch.launcher.stage_launch import _group_spec, _link_spec, watchdog_bounds
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.wire import model_spec_to_proto, schedule_wire_id


def launch_devices(session: ClusterSession, plan: Plan, spec, restore: Restore, checkpoint_root: Path,
                   boundary_bytes: list[int] | None = None) -> dict[tuple[str, int], Placement]:
    """Push every node its RunStage with all its stages, on a fresh data-plane generation."""
    cluster, t, d = session.cluster, session.cluster.train, session.cluster.data
    topology = Topology.of(plan)
    nodes = topology.nodes
    chains = [tuple(dict.fromkeys(q.node for q in stages)) for stages in topology.pipelines]
    if sum(len(chain) for chain in chains) != len(nodes):
        raise ValueError(f"{plan.schedule} runs each node in one pipeline; the plan puts a node in several")
    backend = session.backend_for(list(nodes))
    data = pb.DataSpec(path=str(Path(d.path).resolve()) if d.path else "", seed=d.seed, format=d.format, dtype=d.dtype,
                       eval_fraction=d.eval_fraction)
    model = model_spec_to_proto(spec)
    # Evaluation runs after the step (eval_fill empty); trace.json has a track per node (launcher/timeline.py).
    train = pb.TrainSpec(steps=t.steps, micro_batch_size=plan.micro_batch_size, num_microbatches=plan.num_microbatches,
                         schedule=schedule_wire_id(plan.schedule), lr=t.lr, weight_decay=t.weight_decay, seed=t.seed,
                         checkpoint_dir=str(checkpoint_root) if t.checkpoint_every else "",
                         checkpoint_every=t.checkpoint_every, save_part=True, start_step=restore.step,
                         optimizer=t.optimizer, momentum=t.momentum, lr_schedule=t.lr_schedule,
                         warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip,
                         eval_every=t.eval_every, eval_microbatches=t.eval_microbatches, precision=t.precision,
                         link_rounding=t.link_rounding, trace_every=cluster.observe.trace_every,
                         **watchdog_bounds(t.watchdog_s, plan.predicted_step_s))
    session.begin_generation()
    layout = [pb.StagePlace(rank=device_rank(plan, q.node), pipeline=q.pipeline, layer_start=q.layer_start,
                            layer_end=q.layer_end, region=getattr(q.source, "region", "") or "", node=q.node)
              for q in topology.placements]
    shared = _data_parallel(cluster, plan, chains) if len(chains) > 1 else None
    offset = 0
    for p, (stages, chain, share) in enumerate(zip(topology.pipelines, chains, plan.pipeline_microbatches)):
        for position, name in enumerate(chain):
            command = pb.RunStage(model=model, data=data, train=train,
                                  stage=_node_spec(session, plan, stages, name, position, share, boundary_bytes),
                                  rendezvous=session.rendezvous(device_rank(plan, name), len(nodes), backend, name),
                                  layout=layout)
            command.train.num_microbatches = share
            command.train.save_part = p == 0  # pipeline 0's stages hold every layer once
            command.train.upload_parts = cluster.node(name).launch != "local" and not cluster.checkpoint.dir
            if restore.directory is not None:
                command.restore.checkpoint_dir = str(restore.directory)
            if shared is not None:
                command.data_parallel.CopyFrom(shared)
                command.data_parallel.pipeline_index = p
                command.data_parallel.microbatch_offset = offset
            session.state.send(name, pb.Command(run_stage=command))
        offset += share
    return topology.checkpoint_writers()


def _data_parallel(cluster, plan: Plan, chains: list[tuple[str, ...]]) -> pb.DataParallel:
    """What every node of a several-pipeline plan shares: the global batch, each pipeline's node
    count (its ranks, for its barrier) and share, and the sync groups with their holders' ranks."""
    message = pb.DataParallel(global_microbatches=plan.num_microbatches,
                              pipeline_sizes=[len(chain) for chain in chains],
                              pipeline_microbatches=list(plan.pipeline_microbatches))
    for group in plan.sync_plans():
        message.sync_groups.append(_group_spec(cluster, None, group, rank_of=lambda node: device_rank(plan, node)))
    return message


def _node_spec(session: ClusterSession, plan: Plan, stages: tuple[Placement, ...], name: str, position: int,
               share: int, boundary_bytes: list[int] | None) -> pb.StageSpec:
    """The node's StageSpec: its device, threads and emulation once, and one part per stage it holds."""
    cluster, node = session.cluster, session.cluster.node(name)
    mine = [q for q in stages if q.node == name]
    num_devices = len({q.node for q in stages})
    spec = pb.StageSpec(stage_index=mine[0].stage, num_stages=len(stages), layer_start=mine[0].layer_start,
                        layer_end=mine[0].layer_end, device=session.device_of(name), threads=session.threads_of(name),
                        emulate=pb.Emulation(speed=node.emulate.speed,
                                             speed_changes=[pb.SpeedChange(at_step=c.at_step, speed=c.speed)
                                                            for c in node.emulate.speed_changes],
                                             memory_gb=node.emulate.memory_gb or 0.0),
                        memory_fraction=node.memory_fraction or 0.0, device_index=position,
                        num_devices=num_devices)
    order = getattr(mine[0].source, "device_order", "")  # a StagePlan's (a planner's StageCost has none)
    if order:  # the order the planner priced, built from the pipeline's stages as it built it
        lists = device_lists(plan.schedule, num_devices, share, order, [q.source for q in stages])
        spec.device_order = " ".join(str(a) for a in lists[position])
    for q in mine:
        part = spec.parts.add(stage_index=q.stage, layer_start=q.layer_start, layer_end=q.layer_end)
        j = q.stage
        if j > 0:
            prev = stages[j - 1]
            part.prev.CopyFrom(_link_spec(cluster, prev.source, q.source, device_rank(plan, prev.node), boundary_bytes))
        if j < len(stages) - 1:
            after = stages[j + 1]
            part.next.CopyFrom(_link_spec(cluster, q.source, after.source, device_rank(plan, after.node),
                                          boundary_bytes))
    return spec
