"""launch: local — an agent process per node on this machine (the default)."""

from __future__ import annotations

import os
import sys

from hetlaunch.launcher.providers.base import AgentProvider, LaunchContext
from hetlaunch.launcher.providers.processes import ProcessProvider
from hetlaunch.runtime.auth import TOKEN_ENV_VAR


class LocalProvider(ProcessProvider, AgentProvider):
    launch = "local"
    what = "local agent"

    def start(self, ctx: LaunchContext) -> None:
        for node in self.nodes:
            threads = ctx.cluster.threads_for(node, os.cpu_count() or 1)
            env = dict(os.environ)
            env[TOKEN_ENV_VAR] = ctx.token  # never on the command line, where `ps` would show it
            env.setdefault("OMP_NUM_THREADS", str(threads))
            env.setdefault("PYTHONUNBUFFERED", "1")
            command = [sys.executable, "-m", "hetlaunch.runtime.agent", "--coordinator", ctx.coordinator,
                       f"--name={node.name}", "--parent-pid", str(os.getpid()), "--connect-timeout", "30",
                       *ctx.agent_args]  # --name=: a node name is never taken for an option
            self.processes.spawn(node.name, command, ctx.log_path(node.name), env=env)
