"""What runs inside the Ray actor of a `launch: ray` node (launcher/providers/ray.py): it starts
the node's agent as a subprocess of the actor's worker process and answers for it.

Standard library only, and importable without ray or torch: Ray pickles the actor class by
reference, so a Ray node imports this module from its own hetlaunch install.

The agent gets the join token as the first line of its stdin (never on a command line: `ps` on the
Ray node would show it) and keeps stdin open as its lifeline (--stdin-lifeline): the write end
lives only in this actor's process, so when Ray ends the actor (`up` ended or died and its
driver went with it, or the actor was killed) the pipe closes and the agent stops its worker and
exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_CHUNK = 256 * 1024  # log bytes one status() call returns


class AgentHost:
    """One node's agent, started by `start`, asked about by `status`, ended by `stop`/`kill`."""

    def __init__(self, node: str):
        self.node = node
        self.process: subprocess.Popen | None = None
        self.log_path = Path(tempfile.mkdtemp(prefix=f"hetlaunch-{node}-")) / "agent.log"

    def versions(self) -> dict[str, str]:
        """hetlaunch and torch as installed on this Ray node (package metadata: no torch import)."""
        from hetlaunch.runtime.version import hetlaunch_version, torch_version

        return {"hetlaunch": hetlaunch_version(), "torch": torch_version(), "host": os.uname().nodename}

    def start(self, args: list[str], token: str, threads: int) -> int:
        """Start `python -m hetlaunch.runtime.agent ARGS` with the token on stdin; its pid."""
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(threads)
        env["PYTHONUNBUFFERED"] = "1"
        command = [sys.executable, "-m", "hetlaunch.runtime.agent", *args, "--token-file", "-", "--stdin-lifeline"]
        with open(self.log_path, "wb") as log:
            # its own session: a signal for the actor's process group does not skip the lifeline path
            self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.process.stdin.write(token.encode() + b"\n")
            self.process.stdin.flush()
        except BrokenPipeError:  # it already gave up: its exit code and log say why
            pass
        return self.process.pid

    def status(self, offset: int) -> tuple[int | None, bytes]:
        """(exit code or None while it runs, the log from byte `offset` on, at most MAX_CHUNK)."""
        code = self.process.poll() if self.process is not None else None
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return code, log.read(MAX_CHUNK)
        except OSError:
            return code, b""

    def stop(self, grace_s: float) -> int | None:
        """Close the lifeline and give the agent `grace_s` to stop its worker; then SIGTERM, then
        SIGKILL its process group. Its exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            try:
                process.stdin.close()
            except OSError:
                pass
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    try:
                        os.killpg(process.pid, sig)
                    except ProcessLookupError:
                        pass
                try:
                    process.wait(timeout=grace_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        return process.poll()

    def discard(self) -> None:
        """Remove the log's directory on the Ray node (`up` has copied the log)."""
        shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def kill(self) -> int | None:
        """SIGKILL the agent and its worker now (the node was declared lost)."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 5
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.process.poll() if self.process is not None else None
