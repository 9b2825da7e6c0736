"""`hetlaunch agent --serve`: an agent that outlives jobs, for a host that offers its GPUs to
whichever coordinator runs next (deploy/hetlaunch-agent.service runs it under systemd).

It dials the coordinator; when there is none yet, or a job ends, or the coordinator goes away,
it dials again — at once after a job that ended well, else after a backoff that doubles up to a
minute, with jitter so a fleet of agents does not knock in step. Each job is a fresh Agent
(runtime/agent_job.py) under the same name, whose workers end with the job. SIGTERM or SIGINT stops
the running worker and ends the service with exit 0.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
from pathlib import Path

from hetlaunch.runtime.agent_job import Agent
from hetlaunch.runtime.policy import AgentPolicy
from hetlaunch.runtime.tls import ClientTls

MAX_BACKOFF_S = 60.0


def _log(node: str, message: str) -> None:
    print(f"[agent {node}] {message}", file=sys.stderr, flush=True)


def serve(coordinator: str, node_name: str, token: str, connect_timeout_s: float, work_dir: Path,
          credentials: ClientTls | None, policy: AgentPolicy,
          first_backoff_s: float = 1.0, region: str = "", labels: dict[str, str] | None = None) -> int:
    stop = threading.Event()
    current: list[Agent] = []

    def on_signal(signum, _frame) -> None:
        stop.set()
        if current:
            current[0].end(0, f"{signal.Signals(signum).name}: stopping")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    failures = 0
    jobs = 0
    while not stop.is_set():
        agent = Agent(coordinator, token, node_name, work_dir=work_dir, credentials=credentials, policy=policy,
                      region=region, labels=labels)
        agent.in_service = True
        current[:] = [agent]
        code = agent.run(connect_timeout_s)
        current.clear()
        if stop.is_set():
            break
        if code == 0:
            jobs += 1
            failures = 0
            _log(node_name, f"job {jobs} ended; waiting for the next coordinator at {coordinator}")
            delay = first_backoff_s * random.uniform(0.5, 1.0)
        else:
            failures += 1
            delay = min(MAX_BACKOFF_S, first_backoff_s * 2 ** failures) * random.uniform(0.5, 1.0)
            _log(node_name, f"no job (exit {code}); dialing {coordinator} again in {delay:.1f}s")
        stop.wait(delay)
    _log(node_name, f"service stopped after {jobs} job(s)")
    return 0
