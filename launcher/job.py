"""`hetlaunch up`: coordinator, agents, plan, training, run directory — one job, top to bottom."""

from __future__ import annotations

import json
import os
import queue
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from rich.console import Console

from hetlaunch.launcher.coordinator import CoordinatorServer
from hetlaunch.launcher.local_agents import LocalAgents
from hetlaunch.launcher.plan import Plan, static_plan
from hetlaunch.launcher.progress import TrainingProgress, print_plan, print_summary
from hetlaunch.launcher.run_record import RunRecord, StepAggregator
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.codecs import codec_by_name
from hetlaunch.runtime.stage_job import model_spec_to_proto

RENDEZVOUS_TIMEOUT_S = 120.0
SCHEDULES = {"1f1b": pb.SCHEDULE_1F1B, "gpipe": pb.SCHEDULE_GPIPE}


class JobError(Exception):
    """A one-line reason the job could not run or finish."""


@dataclass
class UpOptions:
    run_root: Path = Path("runs")
    run_dir: Path | None = None
    token: str | None = None


def run_up(cluster, options: UpOptions, console: Console) -> Path:
    """Run the cluster's job to the end; return the run directory. Raises JobError on failure."""
    spec = cluster.model.to_spec()
    plan = static_plan(cluster, spec.num_layers())  # bad input fails here, before anything starts
    run_dir = options.run_dir or options.run_root / f"{cluster.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    token = options.token or secrets.token_urlsafe(24)
    coord = cluster.coordinator
    server = CoordinatorServer(coord.host, coord.port, token, [n.name for n in cluster.nodes]).start()
    store = dist.TCPStore(coord.host, 0, is_master=True, wait_for_workers=False)
    agents = LocalAgents()
    try:
        _write_contact(run_dir, server, cluster, token, console)
        for node in cluster.local_nodes:
            agents.start(node.name, server.address, token, run_dir / "logs",
                         cluster.threads_for(node, os.cpu_count() or 1))
        _wait_for_nodes(server, agents, cluster, console)
        print_plan(console, plan)
        start = time.monotonic()
        _launch(server, cluster, plan, spec, store, run_dir)
        record = RunRecord(run_dir)
        try:
            _follow(server, agents, cluster, plan, record, console)
        finally:
            record.close()
        summary = {"run_id": run_dir.name, "plan": plan.to_dict(), **record.summarize(),
                   "wall_s": time.monotonic() - start}
        record.write_summary(summary)
        print_summary(console, summary, run_dir)
        for node in cluster.nodes:
            server.state.send(node.name, pb.Command(shutdown=pb.Shutdown(reason="job finished")))
        agents.wait_all(10.0)
        return run_dir
    finally:
        agents.stop()
        server.stop()
        del store


def _write_contact(run_dir: Path, server: CoordinatorServer, cluster, token: str, console: Console) -> None:
    """Where remote agents (and tests) find the coordinator; the token file only when someone needs it."""
    (run_dir / "coordinator.json").write_text(json.dumps({"address": server.address, "pid": os.getpid()}) + "\n")
    console.print(f"coordinator listening on [bold]{server.address}[/] (run dir {run_dir})")
    if cluster.remote_nodes:
        token_path = run_dir / "token"
        token_path.touch(mode=0o600)
        token_path.write_text(token + "\n")
        for node in cluster.remote_nodes:
            console.print(f"  on {node.host or node.name}: hetlaunch agent --coordinator <this host>:{server.port} "
                          f"--token-file token --name {node.name}")


def _wait_for_nodes(server: CoordinatorServer, agents: LocalAgents, cluster, console: Console) -> None:
    timeout = cluster.coordinator.join_timeout_s
    deadline = time.monotonic() + timeout
    with console.status("waiting for agents to join") as status:
        while True:
            missing = server.state.missing_nodes()
            if not missing:
                return
            with server.state.lock:
                refusals = dict(server.state.refusals)
            if refusals:
                node, why = next(iter(refusals.items()))
                raise JobError(f"node {node} was refused: {why}")
            dead = {n: c for n, c in agents.exited().items() if n in missing}
            if dead:
                node, code = next(iter(dead.items()))
                raise JobError(f"local agent {node} exited with code {code} before joining: "
                               f"{agents.agents[node].log_tail()}")
            if time.monotonic() > deadline:
                by_name = {n.name: n for n in cluster.nodes}
                names = ", ".join(f"{n} ({by_name[n].launch}{', host ' + by_name[n].host if by_name[n].host else ''})"
                                  for n in missing)
                raise JobError(f"nodes never joined within {timeout:g}s: {names}")
            status.update(f"waiting for agents to join: {', '.join(missing)}")
            time.sleep(0.1)


def _stage_device(node, agent_info: pb.AgentInfo) -> str:
    if node.device != "auto":
        return node.device
    has_cuda = any(d.kind == pb.DEVICE_KIND_CUDA for d in agent_info.devices)
    return "cuda" if has_cuda else "cpu"


def _launch(server: CoordinatorServer, cluster, plan: Plan, spec, store: dist.TCPStore, run_dir: Path) -> None:
    """Push every stage its RunStage; NCCL only when every rank computes on CUDA."""
    nodes = {n.name: n for n in cluster.nodes}
    with server.state.lock:
        infos = {name: rec.info for name, rec in server.state.agents.items()}
    devices = [_stage_device(nodes[s.node], infos[s.node]) for s in plan.stages]
    backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"
    t = cluster.train
    train = pb.TrainSpec(steps=t.steps, micro_batch_size=t.micro_batch_size, num_microbatches=t.num_microbatches,
                         schedule=SCHEDULES[t.schedule], lr=t.lr, weight_decay=t.weight_decay, seed=t.seed,
                         checkpoint_dir=str((run_dir / "checkpoint").resolve()) if t.save_checkpoint else "")
    data = pb.DataSpec(path=str(Path(cluster.data.path).resolve()) if cluster.data.path else "", seed=cluster.data.seed)
    model = model_spec_to_proto(spec)
    n = len(plan.stages)
    # The store binds every interface; an empty host tells agents to dial the coordinator's own host.
    store_host = "" if cluster.coordinator.host in ("0.0.0.0", "::") else cluster.coordinator.host
    for rank, stage in enumerate(plan.stages):
        node = nodes[stage.node]
        spec_msg = pb.StageSpec(stage_index=rank, num_stages=n, layer_start=stage.layer_start,
                                layer_end=stage.layer_end, device=devices[rank],
                                threads=cluster.threads_for(node, os.cpu_count() or 1) if node.launch == "local" else 0,
                                emulate=pb.Emulation(speed=node.emulate.speed if node.emulate else 1.0))
        if rank > 0:
            spec_msg.prev.CopyFrom(_link_spec(cluster, plan, rank - 1, rank, peer_rank=rank - 1))
        if rank < n - 1:
            spec_msg.next.CopyFrom(_link_spec(cluster, plan, rank, rank + 1, peer_rank=rank + 1))
        rdzv = pb.Rendezvous(store_host=store_host, store_port=store.port, generation=plan.generation, rank=rank,
                             world_size=n, timeout_s=RENDEZVOUS_TIMEOUT_S, backend=backend)
        command = pb.RunStage(run_id=run_dir.name, model=model, data=data, train=train, stage=spec_msg, rendezvous=rdzv)
        server.state.send(stage.node, pb.Command(run_stage=command))


def _link_spec(cluster, plan: Plan, upstream: int, downstream: int, peer_rank: int) -> pb.LinkSpec:
    """The boundary between stage `upstream` and `upstream + 1`, as seen from one side."""
    up, down = plan.stages[upstream], plan.stages[downstream]
    link = cluster.link_between(up.region, down.region) if up.region != down.region else None
    emulate = link.emulate if link is not None and link.emulate is not None else None
    return pb.LinkSpec(peer_rank=peer_rank,
                       forward_codec=codec_by_name(up.forward_codec).wire_id,
                       backward_codec=codec_by_name(up.backward_codec).wire_id,
                       emulate_bandwidth_mbps=(emulate.bandwidth_mbps or 0.0) if emulate else 0.0,
                       emulate_latency_ms=(emulate.latency_ms or 0.0) if emulate else 0.0)


def _follow(server: CoordinatorServer, agents: LocalAgents, cluster, plan: Plan, record: RunRecord,
            console: Console) -> None:
    """Collect step metrics until every stage reports success; fail fast on any lost or failed stage."""
    state = server.state
    aggregator = StepAggregator({s.node: i for i, s in enumerate(plan.stages)})
    finished: set[str] = set()
    heartbeat_timeout = cluster.coordinator.heartbeat_timeout_s
    with TrainingProgress(console, cluster.train.steps) as progress:
        while len(finished) < len(plan.stages) or len(record.records) < cluster.train.steps:
            try:
                node, metrics = state.steps.get(timeout=0.2)
                step_record = aggregator.add(node, metrics)
                if step_record is not None:
                    record.add(step_record)
                    progress.update(step_record)
            except queue.Empty:
                pass
            while not state.results.empty():
                node, result = state.results.get()
                if not result.ok:
                    raise JobError(f"stage on node {node} failed: {result.error}")
                finished.add(node)
            for node, code in agents.exited().items():
                if node not in finished:
                    raise JobError(f"local agent {node} exited with code {code} during training: "
                                   f"{agents.agents[node].log_tail()}")
            for node, silent in state.silent_for(time.monotonic()).items():
                if silent > heartbeat_timeout and node not in finished:
                    raise JobError(f"lost node {node}: no heartbeat for {silent:.0f}s")
            if len(finished) == len(plan.stages) and state.steps.empty() and len(record.records) < cluster.train.steps:
                raise JobError(f"stages finished but only {len(record.records)} of {cluster.train.steps} steps reported")
