"""Agents that `hetlaunch up` starts on other hosts through the system `ssh` client (launch: ssh).

The system client, not a Python SSH library, so that what the user's ssh already does —
~/.ssh/config Host entries, keys, ssh-agent, ProxyJump, known_hosts — works unchanged. Per node:

1. one short `ssh HOST PYTHON -c ...` asks the remote hetlaunch and torch versions; a missing
   hetlaunch or a mismatch stops `up` with one line before anything else starts there;
2. `ssh HOST PYTHON -m hetlaunch.runtime.agent ... --token-file - --stdin-lifeline` starts the
   agent; the token goes on its stdin (never on a command line, where `ps` on either host shows
   it), and stdin stays open: when it closes — `up` ends, fails, is interrupted or killed, or the
   connection drops — the remote agent stops its worker and exits;
3. the remote agent's output comes back over the connection into runs/<id>/logs/<node>.log.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

from hetlaunch.launcher.config_types import is_loopback
from hetlaunch.launcher.coordinator import host_port
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.node_config import NodeConfig
from hetlaunch.launcher.providers.base import AgentProvider, LaunchContext
from hetlaunch.launcher.providers.processes import ProcessProvider
from hetlaunch.runtime.version import hetlaunch_version, torch_version

VERSION_CHECK_TIMEOUT_S = 60.0
_ASK_VERSIONS = ("import importlib.metadata as m; print('hetlaunch', m.version('hetlaunch')); "
                 "print('torch', m.version('torch'))")


class SshError(Exception):
    """A one-line reason an SSH node cannot be started."""


class SshProvider(ProcessProvider, AgentProvider):
    launch = "ssh"
    what = "agent started over ssh"

    def start(self, ctx: LaunchContext) -> None:
        coord = ctx.cluster.coordinator
        try:
            address = host_port(advertised_host(coord.host, coord.advertise, [n.host for n in self.nodes]), ctx.port)
        except SshError as err:
            raise JobError(str(err)) from None
        with ctx.console.status(f"checking hetlaunch on {len(self.nodes)} host(s) over ssh"):
            with ThreadPoolExecutor(max_workers=min(16, len(self.nodes))) as pool:
                for check in [pool.submit(check_remote_versions, node) for node in self.nodes]:
                    try:
                        check.result()
                    except SshError as err:
                        raise JobError(str(err)) from None
        for node in self.nodes:
            # the token is stdin's first line; stdin stays open as the remote agent's lifeline
            self.processes.spawn(node.name, agent_command(node, address, ctx.agent_args), ctx.log_path(node.name),
                                 stdin_line=ctx.token)
        ctx.console.print(f"started {len(self.nodes)} agent(s) over ssh, dialing {address}")


def ssh_command(node: NodeConfig, remote: list[str]) -> list[str]:
    """`ssh` with the node's options, then `remote` as one safely quoted remote command line."""
    login = ["-l", node.user] if node.user else []
    port = ["-p", str(node.port)] if node.port else []
    # BatchMode: never stop to ask for a password or a host key on a terminal nobody watches.
    # -T after the node's options (the last one counts): a terminal would echo stdin's first line,
    # the join token, into the agent's log, and end the lifeline's EOF.
    return ["ssh", "-o", "BatchMode=yes", *node.ssh_options, "-T", *login, *port, "--", node.host, shlex.join(remote)]


def check_remote_versions(node: NodeConfig) -> None:
    """Raise SshError unless the remote host has hetlaunch and torch of the versions here."""
    where = f"node {node.name} (ssh {node.host})"
    try:
        done = subprocess.run(ssh_command(node, [node.remote_python, "-c", _ASK_VERSIONS]), capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=VERSION_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SshError(f"{where}: no answer within {VERSION_CHECK_TIMEOUT_S:g}s") from None
    except FileNotFoundError:
        raise SshError("launch: ssh needs the ssh client (openssh-client), and `ssh` is not on PATH") from None
    if done.returncode == 255:  # ssh's own failure: cannot connect, authenticate, resolve
        raise SshError(f"{where}: {_last_line(done.stderr) or 'ssh failed'}")
    if done.returncode != 0:
        raise SshError(f"{where}: {node.remote_python} there cannot load hetlaunch ({_last_line(done.stderr)}); "
                       f"install hetlaunch there, or set remote_python to the interpreter that has it")
    theirs = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.count(" ") == 1)
    ours = {"hetlaunch": hetlaunch_version(), "torch": torch_version()}
    if {k: theirs.get(k) for k in ours} != ours:
        raise SshError(f"{where}: remote has hetlaunch {theirs.get('hetlaunch', '?')}, torch {theirs.get('torch', '?')}; "
                       f"this machine has hetlaunch {ours['hetlaunch']}, torch {ours['torch']}; install the same there")


def agent_command(node: NodeConfig, coordinator: str, agent_args: list[str]) -> list[str]:
    return ssh_command(node, [node.remote_python, "-m", "hetlaunch.runtime.agent", "--coordinator", coordinator,
                              f"--name={node.name}", "--token-file", "-", "--stdin-lifeline",
                              "--connect-timeout", "30", *agent_args])


def advertised_host(bound_host: str, advertise: str | None, hosts: list[str] = ()) -> str:
    """The host remote agents dial: coordinator.advertise, else the bound address, else (bound to
    every interface) this machine's name (its host name where getfqdn says `localhost`, as on
    Debian-style hosts). SshError where that is a loopback address and one of `hosts` (where the
    agents run, when known: ssh) is another machine, which would dial itself: such a job must say
    in coordinator.advertise how other machines reach this one."""
    if advertise:
        return advertise
    host = bound_host
    if bound_host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.getfqdn()
        if host == "localhost":
            host = socket.gethostname()
        return host  # bound to every interface: other machines resolve the name by their own DNS
    if is_loopback(host) and any(not is_loopback(h) for h in hosts):
        raise SshError(f"coordinator: agents on other machines would dial {host}, a loopback address; bind "
                       f"coordinator.host to an address they reach (or 0.0.0.0) and set coordinator.advertise "
                       f"to the name they dial (through a reverse tunnel: advertise {host} itself)")
    return host





def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= 200 else line[:197] + "..."
