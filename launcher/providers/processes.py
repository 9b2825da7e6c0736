"""Agents that run as child processes of `hetlaunch up`: the agent itself (launch: local), an
`ssh` client that runs one on another host (launch: ssh), or whatever command a provider starts.

They are started with exec (never a fork of this gRPC-holding process), in their own
session so a terminal's Ctrl-C reaches only `up`, which then stops them in order.
A local agent watches our pid and exits if we vanish, so even a SIGKILL of `up` leaves no
orphan for long; one at the end of an ssh connection stops when its stdin closes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class AgentProcess:
    node: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


class AgentProcesses:
    """One child process per node, its output in the node's log."""

    def __init__(self) -> None:
        self.agents: dict[str, AgentProcess] = {}

    def spawn(self, node: str, command: list[str], log_path: Path, env: dict[str, str] | None = None,
              stdin_line: str | None = None) -> None:
        """Start `command`; with `stdin_line`, its stdin is a pipe whose first line that is, left
        open as the agent's lifeline (closed by `stop`)."""
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as log:
            process = subprocess.Popen(command, env=env,
                                       stdin=subprocess.DEVNULL if stdin_line is None else subprocess.PIPE,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if stdin_line is not None:
            try:
                process.stdin.write(stdin_line.encode() + b"\n")
                process.stdin.flush()
            except BrokenPipeError:  # the command already gave up; its exit code and log say why
                pass
        self.agents[node] = AgentProcess(node, process, log_path)

    def exited(self) -> dict[str, int]:
        """Agents whose process has ended, with exit codes."""
        return {n: a.process.returncode for n, a in self.agents.items() if a.process.poll() is not None}

    def log_tail(self, node: str) -> str:
        agent = self.agents.get(node)
        return agent.log_tail() if agent is not None else ""

    def wait(self, timeout_s: float) -> bool:
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
            signal_group(agent.process, signal.SIGKILL)
            try:
                agent.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace_s: float = 5.0) -> None:
        """Close the lifelines (stdin) and give those agents the grace period to stop their
        workers; SIGTERM every agent still running, then SIGKILL what is left after another."""
        lifelines = [a for a in self.agents.values() if a.process.stdin is not None and a.process.poll() is None]
        for agent in lifelines:
            close_quietly(agent.process.stdin)
        if lifelines:
            self.wait(grace_s)
        for agent in self.agents.values():
            if agent.process.poll() is None:
                signal_group(agent.process, signal.SIGTERM)
        if not self.wait(grace_s):
            for agent in self.agents.values():
                if agent.process.poll() is None:
                    signal_group(agent.process, signal.SIGKILL)
            self.wait(5.0)


class ProcessProvider:
    """The AgentProvider methods of a provider whose agents are AgentProcesses (mixed in first)."""

    def __init__(self, nodes):
        super().__init__(nodes)
        self.processes = AgentProcesses()

    def exited(self) -> dict[str, int]:
        return self.processes.exited()

    def log_tail(self, node: str) -> str:
        return self.processes.log_tail(node)

    def kill(self, node: str) -> None:
        self.processes.kill(node)

    def wait(self, timeout_s: float) -> bool:
        return self.processes.wait(timeout_s)

    def stop(self, grace_s: float = 5.0) -> None:
        self.processes.stop(grace_s)


def close_quietly(stream) -> None:
    try:
        stream.close()
    except OSError:  # the pipe broke: the process is gone already
        pass


def signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the agent leads its own session: reach its children too
    except ProcessLookupError:
        pass
