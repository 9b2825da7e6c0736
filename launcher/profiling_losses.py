"""A node lost while the cluster is measured (its agent gone, or its worker dead while its layers
were timed): dropped where the plan may do without it, declared lost and said in one line; the
job's end where every node is; and the failures that came in behind a failure, for its blame.
Shared by layer timing (launcher/cluster_measurement.py) and link probes (launcher/link_probes.py).
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.session import ClusterSession, first_line

PROFILE_TIMEOUT_S = 600.0  # a profiling run or a round of link probes ends the job after this long
DROPPED = "lost while profiling: "  # how a node dropped while profiling is declared lost


def every_node_lost(session: ClusterSession) -> JobError:
    return JobError("every node was lost while profiling: " + "; ".join(
        f"{node}: {why.removeprefix(DROPPED)}" for node, why in session.lost.items()))


def drop_node(session: ClusterSession, node: str, why: str, reports: dict, console: Console,
          when: str = "while profiling") -> None:
    session.declare_lost(node, f"{DROPPED}{why}")
    reports.pop(node, None)
    console.print(Text(f"lost node {node} {when} ({first_line(why)}): planning without it"))


def profile_failures(session: ClusterSession):
    def more() -> list[tuple[str, str]]:
        failed = []
        while (received := session.state.next_profile(timeout=0)) is not None:
            if not received[1].ok:
                failed.append((received[0], received[1].error))
        return failed
    return more
