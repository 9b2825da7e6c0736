"""Have the agents measure the cluster: layer timings per node (cached), memory, and links.

Links: inside a region a few representative pairs (consecutive nodes, at most
INTRA_REGION_PAIRS), across regions one pair for every region pair — not all n² node
pairs. Each probe's initiator reports latency and bandwidth; the profile gets the node
pairs measured and, per region pair, the median over its probes, which the planner uses
for the pairs nobody measured.
"""

from __future__ import annotations

import itertools
import statistics
import time

from rich.console import Console
from rich.text import Text

from hetlaunch.launcher.planning.batch_sizes import candidate_sizes
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile
from hetlaunch.launcher.profile_cache import cached_node, node_cache_key, store_node
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.session import BLAME_GRACE_S, ClusterSession, first_line, lost_message
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.model_spec import ModelSpec
from hetlaunch.runtime.wire import model_spec_to_proto
from hetlaunch.runtime.version import MEASUREMENT_METHOD, hetlaunch_version

INTRA_REGION_PAIRS = 2
PROFILE_TIMEOUT_S = 600.0
# A link probe failed and no worker death or lost node shows why: the others are waited for this
# long, then aborted. Their own failures, or a dead peer's report, come in well within it (under a
# second here); gloo's connect can wait ten minutes for a peer that failed while it connected.
FAILED_PROBE_GRACE_S = 30.0
DROPPED = "lost while profiling: "  # how a node dropped while profiling is declared lost


def probe_pairs(cluster, names: list[str] | None = None) -> list[tuple[str, str]]:
    """The links worth measuring (among `names`, default all), in the one global order every agent follows."""
    by_region: dict[str, list[str]] = {}
    for node in cluster.nodes:
        if names is not None and node.name not in names:
            continue
        by_region.setdefault(node.region, []).append(node.name)
    pairs = []
    for names in by_region.values():
        pairs += list(zip(names, names[1:]))[:INTRA_REGION_PAIRS]
    for ra, rb in itertools.combinations(by_region, 2):
        pairs.append((by_region[ra][0], by_region[rb][0]))
    return pairs


def _cache_key(session: ClusterSession, name: str, model: str, micro_batch_size: int) -> str:
    node = session.nodes[name]
    devices = [d.name for d in session.state.agent_info(name).devices]
    return node_cache_key(device=session.device_of(name), devices=devices, threads=session.threads_of(name),
                          speed=node.emulate.speed, model=model, micro_batch_size=micro_batch_size,
                          precision=session.cluster.train.precision, version=hetlaunch_version(),
                          measurement=MEASUREMENT_METHOD)


def measure_for_train(session: ClusterSession, spec: ModelSpec, reprofile: bool, console: Console,
                      names: list[str] | None = None) -> Profile:
    """measure_cluster at the train section's profile size; with a global batch the planner picks
    the micro-batch size from, the smallest size it will try is timed too (layers only), so its
    per-token model has two measured sizes and a measured error (launcher/planning/batch_sizes.py)."""
    train = session.cluster.train
    profile = measure_cluster(session, spec, train.profile_size, train.seed, reprofile, console, names)
    if train.fixed_microbatches is not None or session.cluster.pinned:
        return profile
    smallest = candidate_sizes(train.global_batch, train.profile_size)[-1]
    if smallest == train.profile_size:
        return profile
    other = measure_cluster(session, spec, smallest, train.seed, reprofile, console, names, probe_links=False)
    timed = {n.name: n.layer_seconds for n in other.nodes}
    # A node dropped while the second size was timed (cluster_measurement._drop) leaves the profile
    # too, with its links and those of a region it leaves empty (load_profile refuses them in profile.json).
    nodes = [n.model_copy(update={"layer_seconds_by_size": {smallest: timed[n.name]}}) for n in profile.nodes
             if n.name in timed]
    regions = {n.region for n in nodes}
    links = [link for link in profile.links if (link.nodes is not None and set(link.nodes) <= set(timed))
             or (link.regions is not None and set(link.regions) <= regions)]
    return profile.model_copy(update={"nodes": nodes, "links": links})


def measure_cluster(session: ClusterSession, spec: ModelSpec, micro_batch_size: int, seed: int,
                    reprofile: bool, console: Console, names: list[str] | None = None,
                    probe_links: bool = True) -> Profile:
    """Layers first, then links (unless probe_links is False), of the nodes named (default: all).
    Local agents share this machine, so they time their layers one at a time (concurrent
    timings would measure each other), and alike ones once (alike_local_nodes); remote nodes
    all at once."""
    cluster = session.cluster
    model = spec.describe()
    names = [n.name for n in cluster.nodes if (names is None or n.name in names) and n.name not in session.lost]
    # A node whose worker dies (or whose agent is lost) while its layers are timed is dropped and the
    # others planned on, as a node lost in training would be; a pinned cut needs every node it names.
    droppable = not cluster.pinned
    keys = {n: _cache_key(session, n, model, micro_batch_size) for n in names}
    # A bad cache file is reported (one line naming it) and its node measured again; the new entry replaces it.
    # Read once per key: alike nodes share an entry, and a bad one was reported once per node.
    entries = {} if reprofile else {key: cached_node(key, spec.known_num_layers, console) for key in dict.fromkeys(keys.values())}
    cached = {n: entries[keys[n]] for n in names if entries.get(keys[n]) is not None}
    to_measure = [n for n in names if n not in cached]
    session.from_cache = set(cached)  # a plan that cannot be made says where its numbers came from
    proto_model = model_spec_to_proto(spec)

    def command(name: str, measure_layers: bool) -> pb.Profile:
        node = cluster.node(name)
        return pb.Profile(model=proto_model, micro_batch_size=micro_batch_size, seed=seed,
                          device=session.device_of(name), threads=session.threads_of(name),
                          emulate=pb.Emulation(speed=node.emulate.speed, memory_gb=node.emulate.memory_gb or 0.0),
                          measure_layers=measure_layers, precision=cluster.train.precision,
                          memory_fraction=node.memory_fraction or 0.0)

    # Every node reports its device and free memory; cached nodes skip the layer timings.
    reports: dict[str, pb.ReportProfileRequest] = {}
    alike = alike_local_nodes(cluster, to_measure, keys)
    sequential = [n for n in to_measure if cluster.node(n).launch == "local" and n not in alike]
    at_once = [n for n in names if n not in sequential]
    for name in at_once:
        session.state.send(name, pb.Command(profile=command(name, name in to_measure and name not in alike)))
    for name in sequential:  # the next local node starts only when this one has reported
        if name in session.lost:
            continue
        session.state.send(name, pb.Command(profile=command(name, True)))
        _collect(session, [name], reports, console, f"timing layers on {name}", droppable)
    _collect(session, at_once, reports, console, f"profiling {len(at_once)} node(s) ({len(cached)} cached)",
             droppable)
    timed = {}  # cache key -> the node whose report holds its layer timings
    for name, twin in alike.items():  # as the cache gives it on the next run
        if name in session.lost:
            continue
        source = timed.get(keys[name], twin)
        if source in reports:  # a node dropped meanwhile (even one that had reported) has no report left
            timed[keys[name]] = source
            cached[name] = _entry(reports[source])
            continue
        # The node timed for it was lost: this one is timed itself (and the next alike take its timings).
        reports.pop(name, None)
        session.state.send(name, pb.Command(profile=command(name, True)))
        _collect(session, [name], reports, console, f"timing layers on {name}", droppable)
        timed[keys[name]] = name  # if it was dropped too, the next alike one is timed itself
    names = [n for n in names if n not in session.lost]
    if not names:
        raise _every_node_lost(session)

    link_reports = _probe_links(session, names, command, reports, console, droppable) if probe_links else {}
    return _assemble(session, spec, model, micro_batch_size, reports, link_reports, cached, keys)


def _probe_links(session: ClusterSession, names: list[str], command, reports: dict[str, pb.ReportProfileRequest],
                 console: Console, droppable: bool) -> dict[str, pb.ReportProfileRequest]:
    """Every node of `names` joins one data-plane group and probes its pairs (probe_pairs). A
    node whose agent is lost meanwhile breaks the group: it is dropped like one lost while its
    layers were timed (`droppable`), the survivors' probes are aborted, and they probe again
    without it. A worker that dies while its agent lives is not taken as its node's loss:
    under NCCL a dead peer aborts the survivors' workers too, so which one died first cannot
    be told; the others' probes are aborted and every node probes once more, and deaths
    again (or a failure with no node lost) end the job in one line, as before."""
    cluster = session.cluster
    retried = False
    while True:
        names = [n for n in names if n not in session.lost]
        pairs = probe_pairs(cluster, names)
        if not pairs:
            return {}
        rank = {n: i for i, n in enumerate(names)}
        session.begin_generation()
        backend = session.backend_for(names)
        for name in names:
            probe = command(name, False)
            probe.rendezvous.CopyFrom(session.rendezvous(rank[name], len(names), backend, name))
            for a, b in pairs:
                if name in (a, b):
                    peer = b if name == a else a
                    bw, lat = cluster.emulated_link(a, b)
                    probe.probes.append(pb.ProbePeer(peer_rank=rank[peer], peer_node=peer, initiator=name == a,
                                                     emulate_bandwidth_mbps=bw, emulate_latency_ms=lat))
            session.state.send(name, pb.Command(profile=probe))
        link_reports: dict[str, pb.ReportProfileRequest] = {}
        failed, died = _collect_probes(session, names, link_reports, console, f"probing {len(pairs)} link(s)",
                                       droppable)
        lost = [n for n in names if n in session.lost]
        if not lost:
            if died and not retried:
                retried = True
                console.print(Text(f"a worker died while probing links ({', '.join(died)}): probing again"))
                continue
            if failed:
                raise session.blame(failed, "probing links", set(link_reports), _profile_failures(session))
            return link_reports
        for node in lost:
            reports.pop(node, None)  # its layers leave the profile with it
        if all(n in session.lost for n in names):
            raise _every_node_lost(session)
        console.print(Text(f"probing the links again without {', '.join(lost)}"))


def _collect_probes(session: ClusterSession, names: list[str], link_reports: dict[str, pb.ReportProfileRequest],
                    console: Console, what: str, droppable: bool) -> tuple[dict[str, str], list[str]]:
    """Wait until every node of `names` has reported its probes (into `link_reports`), failed
    or been lost; a lost node (its agent gone, even after its probe failed) is dropped where
    `droppable`, else the job ends naming it. Once a worker died or a node was dropped the
    group is broken, and once a probe failed FAILED_PROBE_GRACE_S ago without either showing
    (its cause may still be on its way), it is taken as broken too: the nodes still probing are
    aborted (abort_broken_probe) instead of waited for. A death is waited on BLAME_GRACE_S
    for a lost node behind it (under NCCL a dead host takes its peers' workers with it), so
    that node is dropped and the probe's one retry after deaths is kept. Returns the failures
    (node -> error) and the nodes among them whose worker died."""
    failed: dict[str, str] = {}
    died: list[str] = []
    aborted: set[str] = set()
    first_failure = None  # when the first failure with no cause shown came in

    def settled(node: str) -> bool:
        return node in link_reports or node in failed or node in session.lost or node in aborted

    def drop_lost() -> dict[str, str]:
        lost = session.lost_nodes(set(link_reports))
        if lost and not droppable:
            raise JobError(lost_message(lost))
        for node, why in lost.items():
            failed.pop(node, None)
            _drop(session, node, why, link_reports, console, "while probing links")
        return lost

    def abort_the_rest(why: str) -> None:
        aborted.update(abort_broken_probe(session, [n for n in names if not settled(n)], why))

    deadline = time.monotonic() + PROFILE_TIMEOUT_S
    with console.status(what) as status:
        while not all(settled(n) for n in names):
            received = session.state.next_profile(timeout=0.2)
            if received is None:
                lost = drop_lost()
                if lost:
                    abort_the_rest(f"{', '.join(lost)} lost")
                elif first_failure is not None and time.monotonic() - first_failure > FAILED_PROBE_GRACE_S:
                    abort_the_rest(f"{', '.join(failed)} failed")
                if time.monotonic() > deadline:
                    missing = ", ".join(n for n in names if not settled(n))
                    raise JobError(f"probing links did not finish within {PROFILE_TIMEOUT_S:.0f}s; waiting for {missing}")
                continue
            node, report = received
            if node in session.lost:
                continue  # a dropped node's late report
            if report.ok:
                link_reports[node] = report
            else:
                failed[node] = report.error
                first_failure = first_failure or time.monotonic()
                if report.worker_died:
                    died.append(node)
                    abort_the_rest(f"the worker of {node} died")
            status.update(f"{what}: {sum(n in link_reports for n in names)}/{len(names)} done")
        grace = time.monotonic() + BLAME_GRACE_S
        while died and not any(n in session.lost for n in names) and time.monotonic() < grace:
            if not drop_lost():
                time.sleep(0.2)
    return failed, [n for n in died if n in failed]


def abort_broken_probe(session: ClusterSession, still_probing: list[str], why: str) -> set[str]:
    """Stop the link probes of `still_probing`: a peer of their group is gone. Gloo's connect
    waits for a peer that died mid-connect up to five times the rendezvous timeout (10 minutes
    at 120 s; seen on torch 2.13), and their results are not wanted: the probe runs again. They
    report nothing (runtime/task_relay.py abort_probe)."""
    for node in still_probing:
        session.state.send(node, pb.Command(abort=pb.Abort(reason=f"{why}: probing again", link_probe=True)))
    return set(still_probing)


def alike_local_nodes(cluster, to_measure: list[str], keys: dict[str, str]) -> dict[str, str]:
    """Local nodes to measure -> the first local node before them with the same cache key, whose
    timings they take: one device of this machine, emulated alike, is timed once per profile, as
    the cache gives every such node one entry on the next run. Timed seconds apart, two alike
    emulated nodes came out 15.1-18.8 ms per block over four profiles, up to 1.17x apart in one
    (2026-12-05, this 2-core VM), and the planner cut for a difference that was not there."""
    first: dict[str, str] = {}
    alike = {}
    for name in to_measure:
        if cluster.node(name).launch != "local":
            continue
        if keys[name] in first:
            alike[name] = first[keys[name]]
        else:
            first[keys[name]] = name
    return alike


def _collect(session: ClusterSession, names: list[str], reports: dict[str, pb.ReportProfileRequest],
             console: Console, what: str, droppable: bool = False) -> None:
    """Wait until every node in `names` has reported into `reports`; a report of another node
    (sent earlier, still running) is kept there too, and never ends this wait. `droppable`: a
    node whose worker dies, or whose agent is lost, is dropped (declared lost, said in one line)
    instead of ending the job (link probes: _collect_probes)."""
    if not names:
        return
    deadline = time.monotonic() + PROFILE_TIMEOUT_S
    with console.status(what) as status:
        while not all(n in reports or n in session.lost for n in names):
            received = session.state.next_profile(timeout=0.2)
            if received is None:
                if droppable:  # one that reported and died since goes too: it would break the link probes
                    for node, why in session.lost_nodes(set()).items():
                        _drop(session, node, why, reports, console)
                else:
                    session.check_alive(set(reports))
                if time.monotonic() > deadline:
                    missing = ", ".join(n for n in names if n not in reports)
                    raise JobError(f"profiling did not finish within {PROFILE_TIMEOUT_S:.0f}s; waiting for {missing}")
                continue
            node, report = received
            if node in session.lost:
                continue  # a dropped node's late report
            if not report.ok:
                if droppable and report.worker_died:
                    _drop(session, node, report.error, reports, console)
                    continue
                raise session.blame({node: report.error}, "profiling", set(reports), _profile_failures(session))
            reports[node] = report
            status.update(f"{what}: {sum(n in reports for n in names)}/{len(names)} done")


def _every_node_lost(session: ClusterSession) -> JobError:
    return JobError("every node was lost while profiling: " + "; ".join(
        f"{node}: {why.removeprefix(DROPPED)}" for node, why in session.lost.items()))


def _drop(session: ClusterSession, node: str, why: str, reports: dict, console: Console,
          when: str = "while profiling") -> None:
    session.declare_lost(node, f"{DROPPED}{why}")
    reports.pop(node, None)
    console.print(Text(f"lost node {node} {when} ({first_line(why)}): planning without it"))


def _profile_failures(session: ClusterSession):
    def more() -> list[tuple[str, str]]:
        failed = []
        while (received := session.state.next_profile(timeout=0)) is not None:
            if not received[1].ok:
                failed.append((received[0], received[1].error))
        return failed
    return more


def _entry(report: pb.ReportProfileRequest) -> dict:
    """A node's layer timings as the cache keeps them (launcher/profile_cache.py CacheEntry)."""
    return {"layer_seconds": [l.seconds for l in report.layers],
            "optimizer_seconds": [l.optimizer_seconds for l in report.layers],
            "input_grad_seconds": [l.input_grad_seconds for l in report.layers],
            "weight_grad_seconds": [l.weight_grad_seconds for l in report.layers],
            "codec_seconds_per_byte": dict(report.codec_seconds_per_byte),
            "cpu_per_wall": report.cpu_per_wall or None,
            "cipher_seconds_per_byte": report.cipher_seconds_per_byte or None,
            "layers": [{"param_bytes": l.param_bytes, "activation_bytes": l.activation_bytes,
                        "output_bytes": l.output_bytes} for l in report.layers]}


def _assemble(session: ClusterSession, spec: ModelSpec, model: str, micro_batch_size: int,
              reports: dict[str, pb.ReportProfileRequest], link_reports: dict[str, pb.ReportProfileRequest],
              cached: dict[str, dict], keys: dict[str, str]) -> Profile:
    cluster = session.cluster
    layer_infos = None
    nodes = []
    counts: dict[str, int] = {}
    for node in cluster.nodes:
        if node.name not in reports:  # not measured this time (a lost node)
            continue
        report = reports[node.name]
        if report.layers:
            entry = _entry(report)
            store_node(keys[node.name], entry, session.console)
        else:
            entry = cached[node.name]
        counts[node.name] = len(entry["layer_seconds"])
        if len(set(counts.values())) > 1:  # agents with different code, or a stale cache entry
            raise JobError("the nodes disagree on the model's layer count: " +
                           ", ".join(f"{n} {c}" for n, c in counts.items()) +
                           " (is the same model code installed on every node? --reprofile re-measures)")
        layer_infos = layer_infos or [LayerInfo(**layer) for layer in entry["layers"]]
        info = session.state.agent_info(node.name)
        nodes.append(NodeProfile(name=node.name, region=node.region, device=report.device_name,
                                 memory_bytes=report.memory_bytes, layer_seconds=entry["layer_seconds"],
                                 optimizer_seconds=entry["optimizer_seconds"],
                                 input_grad_seconds=entry.get("input_grad_seconds"),
                                 weight_grad_seconds=entry.get("weight_grad_seconds"),
                                 codec_seconds_per_byte=entry.get("codec_seconds_per_byte"),
                                 host=info.hostname[:255] or None, host_cores=info.cpu_count or None,
                                 cpu_per_wall=entry.get("cpu_per_wall"),
                                 cipher_seconds_per_byte=entry.get("cipher_seconds_per_byte")))
    links, by_regions = [], {}
    for name, report in link_reports.items():
        for probe in report.links:
            links.append(LinkProfile(nodes=(name, probe.peer_node), bandwidth_bytes_per_s=probe.bandwidth_bytes_per_s,
                                     latency_s=probe.latency_s))
            regions = tuple(sorted((cluster.node(name).region, cluster.node(probe.peer_node).region)))
            by_regions.setdefault(regions, []).append(probe)
    for regions, probes in sorted(by_regions.items()):
        links.append(LinkProfile(regions=regions,
                                 bandwidth_bytes_per_s=statistics.median(p.bandwidth_bytes_per_s for p in probes),
                                 latency_s=statistics.median(p.latency_s for p in probes)))
    return Profile(model=ModelIdentity(description=model, num_layers=len(layer_infos)),
                   micro_batch_size=micro_batch_size, seq_len=spec.seq_len, layers=layer_infos, nodes=nodes,
                   links=links)
