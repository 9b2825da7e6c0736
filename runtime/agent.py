"""`hetlaunch agent`: start a node's agent from the command line.

    python -m hetlaunch.runtime.agent --coordinator HOST:PORT --name NODE [--token-file F]

(`hetlaunch agent` is the same.) The flags become an agent policy (which entrypoints, data and
checkpoint paths it accepts, runtime/policy.py), TLS credentials and discovery labels; then either
one Agent joins one job (runtime/agent_job.py), or, for `hetlaunch agent --serve`, a service takes
job after job (runtime/agent_service.py). `up` starts local agents this way and remote ones over SSH with
--stdin-lifeline, which ends the agent when the SSH session closes.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import threading
from pathlib import Path

from hetlaunch.runtime.agent_job import EXIT_LOST_COORDINATOR, Agent, default_work_dir
from hetlaunch.runtime.agent_service import serve as serve_jobs
from hetlaunch.runtime.auth import read_token
from hetlaunch.runtime.labels import parse_labels
from hetlaunch.runtime.policy import AgentPolicy
from hetlaunch.runtime.tls import ClientTls


def run_agent(coordinator: str, node_name: str, token: str, connect_timeout_s: float = 60.0,
              parent_pid: int | None = None, work_dir: Path | None = None,
              credentials: ClientTls | None = None, allow_entrypoints: tuple[str, ...] = (),
              data_roots: tuple[str, ...] = (), checkpoint_roots: tuple[str, ...] = (), serve: bool = False,
              region: str = "", labels: dict[str, str] | None = None, stdin_lifeline: bool = False) -> int:
    work_dir = work_dir or default_work_dir(node_name)
    policy = AgentPolicy.of(allow_entrypoints, data_roots, checkpoint_roots, work_dir)
    if serve:
        return serve_jobs(coordinator, node_name, token, connect_timeout_s, work_dir, credentials, policy,
                          region=region, labels=labels)
    agent = Agent(coordinator, token, node_name, parent_pid, work_dir, credentials, policy, region, labels)
    if stdin_lifeline:
        threading.Thread(target=_exit_when_stdin_closes, args=(agent,), daemon=True).start()
    return agent.run(connect_timeout_s)


def _exit_when_stdin_closes(agent: Agent) -> None:
    """Started over SSH or in a Ray actor by `up`: the connection (or the actor's process) is our
    lifeline. When it closes (up ended, was killed, or the network dropped it) stdin ends, and so
    do we, our worker with us."""
    # os.read on the descriptor, not sys.stdin.buffer: a daemon thread blocked in the buffered
    # reader holds its lock, and the interpreter's shutdown, which closes stdin, then aborts the
    # whole process (SIGABRT, exit 134) in place of the agent's own exit code and message.
    while os.read(sys.stdin.fileno(), 4096):
        pass
    agent.exit(EXIT_LOST_COORDINATOR, "stdin closed (the ssh session or Ray actor that started this agent is gone); "
                                      "exiting")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetlaunch-agent", description="Join a hetlaunch coordinator.")
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--name", default=socket.gethostname(), help="this node's name in the cluster YAML")
    parser.add_argument("--token-file", default=None, help="file holding the join token (else $HETLAUNCH_TOKEN)")
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where checkpoint parts wait for upload (default ~/.cache/hetlaunch/agent/NAME)")
    parser.add_argument("--allow-entrypoint", action="append", default=[],
                        help="fnmatch pattern of model entrypoints this agent runs (default: only the built-in GPT)")
    parser.add_argument("--data-root", action="append", default=[], help="data files may only come from under here")
    parser.add_argument("--checkpoint-root", action="append", default=[],
                        help="checkpoints may only be written or read under here (and the work dir)")
    parser.add_argument("--ca", default=None, help="TLS: the CA that signed the coordinator's certificate")
    parser.add_argument("--cert", default=None, help="mutual TLS: this agent's certificate")
    parser.add_argument("--key", default=None, help="mutual TLS: this agent's private key")
    parser.add_argument("--insecure", action="store_true",
                        help="without --ca, dial a coordinator on another machine in clear text")
    parser.add_argument("--region", default="", help="this node's region, for discovery")
    parser.add_argument("--label", action="append", default=[], help="KEY=VALUE, for discovery (repeat)")
    parser.add_argument("--stdin-lifeline", action="store_true", help="exit when stdin closes (started over SSH)")
    args = parser.parse_args(argv)
    try:
        token = read_token(args.token_file)
        credentials = tls_credentials(args.ca, args.cert, args.key, args.coordinator, args.insecure)
        labels = parse_labels(args.label)
    except ValueError as err:
        print(f"hetlaunch agent: {err}", file=sys.stderr)
        return 2
    return run_agent(args.coordinator, args.name, token, args.connect_timeout, args.parent_pid, args.work_dir,
                     credentials, tuple(args.allow_entrypoint), tuple(args.data_root), tuple(args.checkpoint_root),
                     region=args.region, labels=labels, stdin_lifeline=args.stdin_lifeline)


def tls_credentials(ca: str | None, cert: str | None, key: str | None, coordinator: str = "127.0.0.1:0",
                    insecure: bool = False) -> ClientTls | None:
    """None without --ca (clear text); --cert/--key need --ca. Clear text to a coordinator on another
    machine only with `insecure`, as coordinator.insecure on the other side: the join token goes in
    every call's metadata, and whoever answers at that address (a spoofed name, a TLS coordinator
    dialled without --ca) would read it, then could hand this agent stages and data-plane keys."""
    if ca is None:
        if cert is not None or key is not None:
            raise ValueError("--cert and --key need --ca (the CA that signed the coordinator's certificate)")
        host = coordinator.rsplit(":", 1)[0].strip("[]")
        if not insecure and not _loopback(host):
            raise ValueError(f"--coordinator {coordinator} is another machine: without --ca the join token would "
                             f"cross in clear text; give --ca (the CA of the coordinator's certificate) or, on a "
                             f"network you trust, --insecure")
        return None
    return ClientTls.read(ca, cert, key)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
