"""What runs in a launch: ray node's actor (runtime/ray_agent_host.py), without Ray: the agent gets
the token on stdin, never on a command line, and ends when the process holding its stdin (the
actor's worker) is SIGKILLed — the lifeline that holds even where Ray does not kill a dead
worker's children itself."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import hetlaunch_env, session_processes, wait_for
from ray_cluster import free_port

_HOST = """
import sys, time
from hetlaunch.runtime.ray_agent_host import AgentHost
host = AgentHost(sys.argv[1])
pid = host.start(["--coordinator", sys.argv[2], f"--name={sys.argv[1]}", "--connect-timeout", "60"], sys.argv[3], 1)
print(pid, host.log_path, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_the_agent_ends_when_the_actor_process_is_killed():
    node, token = f"rh{secrets.token_hex(3)}", secrets.token_urlsafe(24)
    # the token reaches the host process the way Ray hands it a method argument; here argv stands in for that
    host = subprocess.Popen([sys.executable, "-c", _HOST, node, f"127.0.0.1:{free_port()}", token],
                            stdout=subprocess.PIPE, text=True, env=hetlaunch_env())
    try:
        pid, log = host.stdout.readline().split()
        agent = wait_for(lambda: session_processes("hetlaunch.runtime.agent", f"--name={node}"), 20, "the agent")[0]
        assert agent.pid == int(pid) and token not in " ".join(agent.cmdline())
        time.sleep(3)  # well into its attempts to reach the (absent) coordinator
        host.send_signal(signal.SIGKILL)  # as Ray ends an actor: no cleanup of ours runs
        host.wait(timeout=10)
        start = time.monotonic()
        wait_for(lambda: not session_processes("hetlaunch.runtime.agent", f"--name={node}"), 20, "the agent to end")
        assert time.monotonic() - start < 10
        text = Path(log).read_text()
        assert "stdin closed (the ssh session or Ray actor that started this agent is gone); exiting" in text, text
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(timeout=10)
        for proc in session_processes("hetlaunch.runtime.agent", f"--name={node}"):
            proc.kill()
        if "log" in locals():
            subprocess.run(["rm", "-rf", str(Path(log).parent)], check=False)
