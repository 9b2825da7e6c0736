"""`hetlaunch up`: a live cluster, a plan, training, the run directory — one job, top to bottom."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from hetlaunch.launcher.planning.plan import Plan, pinned_num_layers, planned, static_plan
from hetlaunch.launcher.planning.planner import plan as plan_pipelines
from hetlaunch.launcher.planning.planner import plan_fixed_cut, price_pipelines
from hetlaunch.launcher.cluster_measurement import measure_cluster
from hetlaunch.launcher.progress import TrainingProgress, print_plan, print_summary
from hetlaunch.launcher.run_record import RunRecord, StepAggregator
from hetlaunch.launcher.session import ClusterSession, JobError
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.wire import codec_wire_id, model_spec_to_proto, schedule_wire_id

__all__ = ["JobError", "UpOptions", "run_up", "make_plan", "new_run_dir"]


@dataclass
class UpOptions:
    run_root: Path = Path("runs")
    run_dir: Path | None = None
    token: str | None = None
    reprofile: bool = False


def new_run_dir(cluster, options: UpOptions) -> Path:
    return options.run_dir or options.run_root / f"{cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def make_plan(session: ClusterSession, spec, reprofile: bool, console: Console) -> Plan:
    """Measure the cluster and plan from the profile. Pinned `layers:` are used as they are, with
    no measuring at all when every codec is pinned too (else the codecs are planned)."""
    cluster = session.cluster
    train = cluster.train
    pinned = None
    if all(n.layers is not None for n in cluster.nodes):
        pinned = static_plan(cluster, pinned_num_layers(cluster))
        if not _codec_choice_left(cluster, pinned):
            return pinned
    profile = measure_cluster(session, spec, train.micro_batch_size, train.seed, reprofile, console)
    if pinned is None:
        max_pipelines = len(cluster.nodes) if train.max_pipelines == "auto" else train.max_pipelines
        # Seconds to tens of seconds: every chain of up to 6 nodes, pairs of them, codecs per boundary.
        with console.status(f"planning up to {max_pipelines} pipelines over {len(profile.nodes)} nodes"):
            result = plan_pipelines(profile, train.num_microbatches, train.schedule, max_pipelines=max_pipelines,
                                    compression=cluster.compression)
        console.print(f"planned in {result.planning_s:.1f}s ({result.method} search)")
        return planned(cluster, result)
    chains = [([s.node for s in stages], [(s.layer_start, s.layer_end) for s in stages])
              for stages in pinned.pipelines()]
    if len(chains) == 1:
        result = plan_fixed_cut(profile, *chains[0], train.num_microbatches, train.schedule, cluster.compression)
    else:
        result = price_pipelines(profile, [(nodes, cuts, share) for (nodes, cuts), share
                                           in zip(chains, pinned.pipeline_microbatches)],
                                 train.schedule, cluster.compression)
    return planned(cluster, result, source="pinned")


def _codec_choice_left(cluster, plan: Plan) -> bool:
    """Does some boundary of this cut, or the sync between its pipelines, leave its codec to `auto`?"""
    policy = cluster.compression
    if len(plan.pipelines()) > 1 and policy.sync == "auto":
        return True
    return any(len(policy.candidates(j, a.region == b.region)) > 1
               for stages in plan.pipelines() for j, (a, b) in enumerate(zip(stages, stages[1:])))


def run_up(cluster, options: UpOptions, console: Console) -> Path:
    """Run the cluster's job to the end; return the run directory. Raises JobError on failure."""
    spec = cluster.model.to_spec()
    if all(n.layers is not None for n in cluster.nodes):
        static_plan(cluster, pinned_num_layers(cluster))  # bad pinned ranges fail here, before anything starts
    run_dir = new_run_dir(cluster, options)
    with ClusterSession(cluster, run_dir, options.token or secrets.token_urlsafe(24), console) as session:
        plan = make_plan(session, spec, options.reprofile, console)
        print_plan(console, plan)
        for node in plan.excluded or {}:
            session.state.send(node, pb.Command(shutdown=pb.Shutdown(reason="not in the plan")))
        start = time.monotonic()
        _launch(session, plan, spec)
        record = RunRecord(run_dir)
        try:
            _follow(session, plan, record, console)
        finally:
            record.close()
        summary = {"run_id": run_dir.name, "plan": plan.to_dict(), **record.summarize(),
                   "wall_s": time.monotonic() - start}
        record.write_summary(summary)
        print_summary(console, summary, run_dir)
        return run_dir


def _launch(session: ClusterSession, plan: Plan, spec) -> None:
    """Push every stage its RunStage on a fresh data-plane generation."""
    cluster = session.cluster
    backend = session.backend_for([s.node for s in plan.stages])
    t = cluster.train
    data = pb.DataSpec(path=str(Path(cluster.data.path).resolve()) if cluster.data.path else "", seed=cluster.data.seed)
    model = model_spec_to_proto(spec)
    pipelines = plan.pipelines()
    world = len(plan.stages)
    data_parallel = _data_parallel(cluster, plan) if len(pipelines) > 1 else None
    session.begin_generation()
    offset = rank = 0  # ranks follow plan.stages: pipeline after pipeline
    for p, (stages, share) in enumerate(zip(pipelines, plan.pipeline_microbatches)):
        train = pb.TrainSpec(steps=t.steps, micro_batch_size=t.micro_batch_size, num_microbatches=share,
                             schedule=schedule_wire_id(t.schedule), lr=t.lr, weight_decay=t.weight_decay, seed=t.seed,
                             checkpoint_dir=str((session.run_dir / "checkpoint").resolve()) if t.save_checkpoint else "")
        n = len(stages)
        for j, stage in enumerate(stages):
            node = cluster.node(stage.node)
            spec_msg = pb.StageSpec(stage_index=j, num_stages=n, layer_start=stage.layer_start,
                                    layer_end=stage.layer_end, device=session.device_of(stage.node),
                                    threads=session.threads_of(stage.node),
                                    emulate=pb.Emulation(speed=node.emulate.speed))
            if j > 0:
                spec_msg.prev.CopyFrom(_link_spec(cluster, stages[j - 1], stage, peer_rank=rank - 1))
            if j < n - 1:
                spec_msg.next.CopyFrom(_link_spec(cluster, stage, stages[j + 1], peer_rank=rank + 1))
            command = pb.RunStage(model=model, data=data, train=train, stage=spec_msg,
                                  rendezvous=session.rendezvous(rank, world, backend))
            if data_parallel is not None:
                command.data_parallel.CopyFrom(data_parallel)
                command.data_parallel.pipeline_index = p
                command.data_parallel.microbatch_offset = offset
            session.state.send(stage.node, pb.Command(run_stage=command))
            rank += 1
        offset += share


def _data_parallel(cluster, plan: Plan) -> pb.DataParallel:
    """What every stage of a several-pipeline plan shares: the global batch and all sync groups."""
    rank = {stage.node: i for i, stage in enumerate(plan.stages)}
    message = pb.DataParallel(global_microbatches=plan.num_microbatches)
    for group in plan.sync_plans():
        bw, lat = _slowest_emulated_link(cluster, group.nodes)
        message.sync_groups.add(layer_start=group.layer_start, layer_end=group.layer_end,
                                ranks=[rank[name] for name in group.nodes], codec=codec_wire_id(group.codec),
                                emulate_bandwidth_mbps=bw, emulate_latency_ms=lat)
    return message


def _slowest_emulated_link(cluster, nodes: tuple[str, ...]) -> tuple[float, float]:
    """A sync group runs at its slowest link: the lowest emulated bandwidth, the highest latency."""
    pairs = [cluster.emulated_link(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    limited = [bw for bw, _ in pairs if bw > 0]
    return (min(limited) if limited else 0.0), max((lat for _, lat in pairs), default=0.0)


def _link_spec(cluster, up, down, peer_rank: int) -> pb.LinkSpec:
    """The boundary between stages `up` and `down` of one pipeline, as seen from one side."""
    bw, lat = cluster.emulated_link(up.node, down.node)
    return pb.LinkSpec(peer_rank=peer_rank, forward_codec=codec_wire_id(up.forward_codec),
                       backward_codec=codec_wire_id(up.backward_codec),
                       emulate_bandwidth_mbps=bw, emulate_latency_ms=lat)


def _follow(session: ClusterSession, plan: Plan, record: RunRecord, console: Console) -> None:
    """Collect step metrics until every stage reports success; fail fast on any lost or failed stage."""
    state = session.state
    steps = session.cluster.train.steps
    aggregator = StepAggregator(plan)
    finished: set[str] = set()
    idle = set(plan.excluded or {})  # told to shut down before training; their exit is expected
    with TrainingProgress(console, steps) as progress:
        while len(finished) < len(plan.stages) or len(record.records) < steps:
            received = state.next_step(timeout=0.2)
            if received is not None:
                step_record = aggregator.add(*received)
                if step_record is not None:
                    record.add(step_record)
                    progress.update(step_record)
            failures = {}
            for node, result in state.results():
                if result.ok:
                    finished.add(node)
                else:
                    failures[node] = result.error
            if failures:
                raise session.blame(failures, "stage", finished | idle)
            session.check_alive(finished | idle)
            if len(finished) == len(plan.stages) and not state.steps_pending() and len(record.records) < steps:
                raise JobError(f"stages finished but only {len(record.records)} of {steps} steps reported")
