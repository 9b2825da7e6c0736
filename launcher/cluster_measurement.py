"""Have the agents measure the cluster: layer timings per node (cached), memory, and links
(probed by launcher/link_probes.py). The profile gets the node pairs measured and, per region
pair, the median over its probes, which the planner uses for the pairs nobody measured.
"""

from __future__ import annotations

import statistics
import time

from pydantic import ValidationError
from rich.console import Console

from hetlaunch.launcher.planning.batch_sizes import candidate_sizes
from hetlaunch.launcher.planning.profile_file import LayerInfo, LinkProfile, ModelIdentity, NodeProfile, Profile
from hetlaunch.launcher.profile_cache import cached_node, node_cache_key, store_node
from hetlaunch.launcher.link_probes import measure_links
from hetlaunch.launcher.profiling_losses import PROFILE_TIMEOUT_S, drop_node, every_node_lost, profile_failures
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.session import ClusterSession
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.model_spec import ModelSpec
from hetlaunch.runtime.wire import model_spec_to_proto
from hetlaunch.runtime.version import MEASUREMENT_METHOD, hetlaunch_version


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
    # A node dropped while the second size was timed (profiling_losses.drop_node) leaves the profile
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
        raise every_node_lost(session)

    link_reports = measure_links(session, names, command, reports, console, droppable) if probe_links else {}
    return _assemble(session, spec, model, micro_batch_size, reports, link_reports, cached, keys)


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
                        drop_node(session, node, why, reports, console)
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
                    drop_node(session, node, report.error, reports, console)
                    continue
                raise session.blame({node: report.error}, "profiling", set(reports), profile_failures(session))
            reports[node] = report
            status.update(f"{what}: {sum(n in reports for n in names)}/{len(names)} done")


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
    """The profile from the nodes' reports; JobError (one line) where a report is not a measurement
    (an agent that reported 0 bytes of memory or NaN seconds ended `up` with a traceback; a review)."""
    try:
        return _assembled(session, spec, model, micro_batch_size, reports, link_reports, cached, keys)
    except ValidationError as err:
        raise JobError(f"the nodes' reports make no profile: {_first_error(err)}") from None


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    return ".".join(str(part) for part in first["loc"]) + ": " + first["msg"]


def _assembled(session: ClusterSession, spec: ModelSpec, model: str, micro_batch_size: int,
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
        entry = _entry(report) if report.layers else cached[node.name]
        counts[node.name] = len(entry["layer_seconds"])
        if len(set(counts.values())) > 1:  # agents with different code, or a stale cache entry
            raise JobError("the nodes disagree on the model's layer count: " +
                           ", ".join(f"{n} {c}" for n, c in counts.items()) +
                           " (is the same model code installed on every node? --reprofile re-measures)")
        layer_infos = layer_infos or [LayerInfo(**layer) for layer in entry["layers"]]
        info = session.state.agent_info(node.name)
        try:
            measured_node = NodeProfile(name=node.name, region=node.region, device=report.device_name,
                                        memory_bytes=report.memory_bytes, layer_seconds=entry["layer_seconds"],
                                        optimizer_seconds=entry["optimizer_seconds"],
                                        input_grad_seconds=entry.get("input_grad_seconds"),
                                        weight_grad_seconds=entry.get("weight_grad_seconds"),
                                        codec_seconds_per_byte=entry.get("codec_seconds_per_byte"),
                                        host=info.hostname[:255] or None, host_cores=info.cpu_count or None,
                                        cpu_per_wall=entry.get("cpu_per_wall"),
                                        cipher_seconds_per_byte=entry.get("cipher_seconds_per_byte"))
        except ValidationError as err:
            raise JobError(f"node {node.name} reported a profile that is not a measurement: {_first_error(err)}") from None
        nodes.append(measured_node)
        if report.layers:  # stored once it has passed as a measurement: a bad report is not kept for the next run
            store_node(keys[node.name], entry, session.console)
    links, by_regions = [], {}
    measured = {n.name for n in nodes}
    for name, report in link_reports.items():
        for probe in report.links:
            if probe.peer_node not in measured or name not in measured:
                continue  # a probe of a node this profile does not have (a node it was never asked to probe)
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
