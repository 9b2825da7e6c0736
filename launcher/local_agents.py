"""Agents that `hetlaunch up` starts as fresh subprocesses: on this machine, or an `ssh` client
that runs one on another host (launcher/ssh_agents.py).

They are started with exec (never a fork of this gRPC-holding process), in their own
session so a terminal's Ctrl-C reaches only `up`, which then stops them in order.
Each one watches our pid and exits if we vanish, so even a SIGKILL of `up` leaves no
orphan for long.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hetlaunch.runtime.auth import TOKEN_ENV_VAR


@dataclass
class LocalAgent:
    node: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


class LocalAgents:
    def __init__(self) -> None:
        self.agents: dict[str, LocalAgent] = {}

    def start(self, node: str, coordinator: str, token: str, log_dir: Path, threads: int,
              tls_args: list[str] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{node}.log"
        env = dict(os.environ)
        env[TOKEN_ENV_VAR] = token  # never on the command line, where `ps` would show it
        env.setdefault("OMP_NUM_THREADS", str(threads))
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, "-m", "hetlaunch.runtime.agent", "--coordinator", coordinator,
               f"--name={node}", "--parent-pid", str(os.getpid()), "--connect-timeout", "30",
               *(tls_args or [])]  # --name=: a node name is never taken for an option
        with open(log_path, "w") as log:
            process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.agents[node] = LocalAgent(node, process, log_path)

    def start_over_ssh(self, node: str, ssh_command: list[str], token: str, log_dir: Path) -> None:
        """Run `ssh ... agent --token-file - --stdin-lifeline` (launcher/ssh_agents.py): the token
        is its stdin's first line, and the open stdin is the remote agent's lifeline."""
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{node}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(ssh_command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            process.stdin.write(token.encode() + b"\n")
            process.stdin.flush()
        except BrokenPipeError:  # ssh already gave up; its exit code and log say why
            pass
        self.agents[node] = LocalAgent(node, process, log_path)

    def exited(self) -> dict[str, int]:
        """Agents whose process has ended, with exit codes."""
        return {n: a.process.returncode for n, a in self.agents.items() if a.process.poll() is not None}

    def wait_all(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for agent in self.agents.values():
            remaining = deadline - time.monotonic()
            try:
                agent.process.wait(timeout=max(remaining, 0.01))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self, node: str) -> None:
        """SIGKILL one agent and its worker (its process group), e.g. after it was declared lost."""
        agent = self.agents.get(node)
        if agent is not None and agent.process.poll() is None:
            _signal_group(agent.process, signal.SIGKILL)
            try:
                agent.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace_s: float = 5.0) -> None:
        """Close the lifeline of agents over SSH and give them the grace period to stop their
        workers; SIGTERM every agent still running, then SIGKILL what is left after another."""
        lifelines = [a for a in self.agents.values() if a.process.stdin is not None and a.process.poll() is None]
        for agent in lifelines:
            _close(agent.process.stdin)
        if lifelines:
            self.wait_all(grace_s)
        for agent in self.agents.values():
            if agent.process.poll() is None:
                _signal_group(agent.process, signal.SIGTERM)
        if not self.wait_all(grace_s):
            for agent in self.agents.values():
                if agent.process.poll() is None:
                    _signal_group(agent.process, signal.SIGKILL)
            self.wait_all(5.0)


def _close(stream) -> None:
    try:
        stream.close()
    except OSError:  # the pipe broke: ssh is gone already
        pass


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the agent leads its own session: reach its children too
    except ProcessLookupError:
        pass
