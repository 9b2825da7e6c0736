"""Link probes: which links the agents measure, and the round in which they measure them.

Inside a region a few representative pairs (consecutive nodes, at most INTRA_REGION_PAIRS),
across regions one pair for every region pair — not all n² node pairs. Every node of the round
joins one data-plane group; each probe's initiator reports latency and bandwidth. A node lost or
a worker dead mid-round breaks the group: the others' probes are aborted and the round runs again
(launcher/cluster_measurement.py turns the reports into the profile's links).
"""

from __future__ import annotations

import itertools
import time

from rich.console import Console
from rich.text import Text

from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.profiling_losses import PROFILE_TIMEOUT_S, drop_node, every_node_lost, profile_failures
from hetlaunch.launcher.session import BLAME_GRACE_S, ClusterSession, lost_message
from hetlaunch.protos import control_pb2 as pb

INTRA_REGION_PAIRS = 2
# A link probe failed and no worker death or lost node shows why: the others are waited for this
# long, then aborted. Their own failures, or a dead peer's report, come in well within it (under a
# second here); gloo's connect can wait ten minutes for a peer that failed while it connected.
FAILED_PROBE_GRACE_S = 30.0


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


def measure_links(session: ClusterSession, names: list[str], command, reports: dict[str, pb.ReportProfileRequest],
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
                raise session.blame(failed, "probing links", set(link_reports), profile_failures(session))
            return link_reports
        for node in lost:
            reports.pop(node, None)  # its layers leave the profile with it
        if all(n in session.lost for n in names):
            raise every_node_lost(session)
        console.print(Text(f"probing the links again without {', '.join(lost)}"))


def _collect_probes(session: ClusterSession, names: list[str], link_reports: dict[str, pb.ReportProfileRequest],
                    console: Console, what: str, droppable: bool) -> tuple[dict[str, str], list[str]]:
    """Wait until every node of `names` has reported its probes (into `link_reports`), failed
    or been lost; a lost node (its agent gone, even after its probe failed) is dropped where
    `droppable`, else the job ends naming it. Once a worker died or a node was dropped the
    group is broken, and once a probe failed FAILED_PROBE_GRACE_S ago (or the heartbeat
    timeout and 10 s) without either showing (its cause may still be on its way), it is broken
    too: the nodes still probing are aborted (abort_broken_probe) instead of waited for. A death is waited on BLAME_GRACE_S
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
            drop_node(session, node, why, link_reports, console, "while probing links")
        return lost

    def abort_the_rest(why: str) -> None:
        aborted.update(abort_broken_probe(session, [n for n in names if not settled(n)], why))

    # Past the heartbeat timeout too: a host that died silently (its peers' probes failed on it)
    # must show as lost before the others are aborted, or the round ends with no node to drop.
    grace = max(FAILED_PROBE_GRACE_S, session.cluster.coordinator.heartbeat_timeout_s + 10.0)
    deadline = time.monotonic() + PROFILE_TIMEOUT_S
    with console.status(what) as status:
        while not all(settled(n) for n in names):
            received = session.state.next_profile(timeout=0.2)
            if received is None:
                lost = drop_lost()
                if lost:
                    abort_the_rest(f"{', '.join(lost)} lost")
                elif first_failure is not None and time.monotonic() - first_failure > grace:
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
        until = time.monotonic() + BLAME_GRACE_S
        while died and not any(n in session.lost for n in names) and time.monotonic() < until:
            if not drop_lost():
                time.sleep(0.2)
    return failed, [n for n in died if n in failed]


def abort_broken_probe(session: ClusterSession, still_probing: list[str], why: str) -> set[str]:
    """Stop the link probes of `still_probing`: a peer of their group is gone. Gloo's connect
    waits for a peer that died mid-connect up to five times the rendezvous timeout (10 minutes
    at 120 s; seen on torch 2.13), and their results are not wanted: the probe runs again. They
    report nothing (runtime/task_relay.py abort_probe)."""
    for node in still_probing:
        session.state.send(node, pb.Command(abort=pb.Abort(reason=why, link_probe=True)))
    return set(still_probing)
