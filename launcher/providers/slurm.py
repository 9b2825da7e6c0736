"""Agents that `hetlaunch up` starts inside a Slurm allocation (launch: slurm).

Per group of the YAML's top-level `slurm:` list (launcher/slurm_config.py):

1. `salloc --nodes=N [--partition ...] -- sh -c 'echo hetlaunch-allocation $SLURM_JOB_ID ...; cat'`
   asks for one allocation of as many nodes as the group has. Its command runs here, on the machine
   of `up`, and holds the allocation for as long as its stdin stays open: when `up` ends — even by
   SIGKILL, when nobody runs `scancel` — the pipe closes, `cat` ends and salloc gives the
   allocation back. A job Slurm refuses is one line with Slurm's reason; one that does not start
   within the group's wait_s is one line with its squeue state.
2. `srun --jobid=ID --nodes=1 --ntasks=1 --nodelist=HOST PYTHON -m hetlaunch.runtime.agent ...
   --token-file - --stdin-lifeline` starts each node's agent on its Slurm node; srun forwards our
   stdin to the task, so the token is stdin's first line (never on a command line or in the job's
   environment) and the open pipe is the agent's lifeline, as over ssh. srun passes our
   environment on (PYTHONPATH, ...) and brings the agent's output back into logs/<node>.log.
3. Stop: close the lifelines (agents stop their workers and exit, their steps end), then `scancel`
   the job and close salloc's stdin.

A node's `host:` pins the Slurm node it runs on; the others get the allocation's remaining nodes.
Groups that name the same `het_job` are the components of one heterogeneous job (salloc A : B),
and each agent's srun names its --het-group.
Slurm does not requeue anything here (an interactive allocation never is): an agent whose step
ends is a lost node to `up`, which re-plans on the others. The allocation is asked with --no-kill,
so a node Slurm marks failed ends only its own step instead of the whole group's job.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hetlaunch.launcher.coordinator import host_port
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.providers.base import AgentProvider, LaunchContext
from hetlaunch.launcher.providers.processes import ProcessProvider, close_quietly, signal_group
from hetlaunch.launcher.providers.ssh import advertised_host
from hetlaunch.launcher.slurm_config import SlurmGroup, slurm_group_of
from hetlaunch.runtime.auth import TOKEN_ENV_VAR

TOOLS = ("salloc", "srun", "scancel", "squeue", "scontrol")
QUERY_TIMEOUT_S = 20.0  # one squeue / scontrol / scancel call
MARK = "hetlaunch-allocation"  # the line the allocation's command prints: MARK JOBID NODELIST...


class SlurmProvider(ProcessProvider, AgentProvider):
    launch = "slurm"
    what = "agent started with srun"

    def __init__(self, nodes):
        super().__init__(nodes)
        self.allocations: list[Allocation] = []

    def preflight(self) -> None:
        missing = [tool for tool in TOOLS if shutil.which(tool) is None]
        if missing:
            raise JobError(f"launch: slurm needs Slurm's client commands on PATH on this machine, and "
                           f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not (install slurm-client)")

    def start(self, ctx: LaunchContext) -> None:
        env = slurm_env()
        jobs: dict[str, dict[str, Component]] = {}  # one allocation per het_job (else per group), its groups
        for node in self.nodes:
            group = slurm_group_of(ctx.cluster, node)
            key = f"het_job@{group.het_job}" if group.het_job else group.name  # '@' is in no name
            components = jobs.setdefault(key, {})
            components.setdefault(group.name, Component(group, len(components))).nodes.append(node)
        for key, components in jobs.items():  # ask for every allocation first: they may wait side by side
            self.allocations.append(Allocation(key, list(components.values()), ctx.log_dir, env))
        coord = ctx.cluster.coordinator
        address = host_port(advertised_host(coord.host, coord.advertise), ctx.port)
        for allocation in self.allocations:
            allocation.wait_started(ctx)
            het = len(allocation.components) > 1
            for part in allocation.components:
                placed = allocation.placement(part)
                for node, host in placed.items():
                    command = ["srun", f"--jobid={allocation.job_id}", *([f"--het-group={part.index}"] if het else []),
                               "--nodes=1", "--ntasks=1", f"--nodelist={host}", *part.group.srun_options,
                               part.group.python or sys.executable, "-m", "hetlaunch.runtime.agent",
                               "--coordinator", address, f"--name={node}", "--token-file", "-", "--stdin-lifeline",
                               "--connect-timeout", "30", *ctx.agent_args]
                    self.processes.spawn(node, command, ctx.log_path(node), env=env, stdin_line=ctx.token)
                ctx.console.print(f"slurm group {part.group.name}: job {allocation.job_id}"
                                  + (f" (heterogeneous job {allocation.key}, component {part.index})" if het else "")
                                  + ", agents " + ", ".join(f"{n} on {h}{allocation.gres(h)}" for n, h in placed.items())
                                  + f", dialing {address}")

    def kill(self, node: str) -> None:
        """Close the node's lifeline and SIGTERM its srun (which signals the task and ends the step);
        SIGKILL it if it has not ended within 10s."""
        agent = self.processes.agents.get(node)
        if agent is None or agent.process.poll() is not None:
            return
        if agent.process.stdin is not None:
            close_quietly(agent.process.stdin)
        agent.process.terminate()
        try:
            agent.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.processes.kill(node)

    def stop(self, grace_s: float = 5.0) -> None:
        try:
            self.processes.stop(grace_s)
        finally:
            for allocation in self.allocations:
                allocation.release()


@dataclass
class Component:
    """One group's part of an allocation (the het group `index` of a heterogeneous job)."""

    group: SlurmGroup
    index: int
    nodes: list = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    @property
    def what(self) -> str:
        asked = [f"{len(self.nodes)} node(s)"]
        asked += [f"{key} {getattr(self.group, key)}" for key in ("partition", "account") if getattr(self.group, key)]
        return f"{self.group.name} ({', '.join(asked)})"


class Allocation:
    """One Slurm job (heterogeneous when it has several components): a salloc process whose command
    holds it while its stdin is open."""

    def __init__(self, key: str, components: list[Component], log_dir: Path, env: dict[str, str]):
        self.components = components
        self.job_id: str | None = None
        self._gres: dict[str, str] = {}
        self.wait_s = max(c.group.wait_s for c in components)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"salloc@{key}.log"  # '@' is in no node name: never a node's log
        self.key = key.split("@")[-1]
        self.env = env
        self.started_at = time.monotonic()
        granted = log_dir / f"salloc@{key}.granted"  # made by salloc's command once the allocation runs
        granted.unlink(missing_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(salloc_command(components, granted), env=env, stdin=subprocess.PIPE,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def what(self) -> str:
        if len(self.components) == 1:
            return f"slurm group {self.components[0].what}"
        return f"slurm heterogeneous job {self.key} (groups {'; '.join(c.what for c in self.components)})"

    def _log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_started(self, ctx: LaunchContext) -> None:
        """Until salloc's command says the allocation runs; JobError (one line) if Slurm refuses it,
        or it has not started within the groups' wait_s."""
        deadline = self.started_at + self.wait_s
        with ctx.console.status(f"{self.what}: waiting for Slurm to start the allocation") as status:
            while True:
                text = self._log()
                found = re.search(rf"^{MARK} (\S+)((?: \S+)+)$", text, re.M)
                if found:
                    self.job_id = found.group(1)
                    nodelists = found.group(2).split()
                    for part, nodelist in zip(self.components, nodelists):
                        part.hosts = self._expand(part, nodelist)
                    self._gres = self._query_gres([h for part in self.components for h in part.hosts])
                    return
                job = re.search(r"job allocation (\d+)", text)
                self.job_id = job.group(1) if job else self.job_id
                if self.process.poll() is not None:  # read again: it may have written its reason since `text`
                    if re.search(r"Granted job allocation", text):  # granted, then salloc ended: release cancels it
                        raise JobError(f"{self.what}: salloc exited before starting job {self.job_id}'s agents: "
                                       f"{salloc_errors(self._log())}")
                    raise JobError(f"{self.what}: Slurm refused the allocation: {salloc_errors(self._log())}")
                if time.monotonic() > deadline:
                    state = self._state() if self.job_id else "not queued yet"
                    raise JobError(f"{self.what}: Slurm did not start job {self.job_id or '?'} within "
                                   f"{self.wait_s:g}s (slurm wait_s); it is {state}")
                if self.job_id:
                    status.update(f"{self.what}: waiting for Slurm to start job {self.job_id}")
                time.sleep(0.2)

    def placement(self, part: Component) -> dict[str, str]:
        """Node name -> Slurm node: pinned ones (`host:`) where they asked, the others in order."""
        free = [h for h in part.hosts if h not in {n.host for n in part.nodes if n.host}]
        placed = {}
        for node in part.nodes:
            if node.host:
                if node.host not in part.hosts:
                    raise JobError(f"{self.what}: node {node.name} asks for host {node.host}, which is not in "
                                   f"job {self.job_id}'s nodes ({', '.join(part.hosts)})")
                placed[node.name] = node.host
            else:
                placed[node.name] = free.pop(0)
        return placed

    def gres(self, host: str) -> str:
        """What Slurm says the node has (", gres gpu:a100:2"), or ""."""
        found = self._gres.get(host, "")
        return f" (gres {found})" if found else ""

    def _run(self, *command: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(list(command), capture_output=True, text=True, timeout=QUERY_TIMEOUT_S,
                                  env=self.env, stdin=subprocess.DEVNULL)
        except (subprocess.TimeoutExpired, OSError):
            return None

    def _expand(self, part: Component, nodelist: str) -> list[str]:
        done = self._run("scontrol", "show", "hostnames", nodelist)
        if done is None or done.returncode != 0 or not done.stdout.split():
            raise JobError(f"{self.what}: cannot read job {self.job_id}'s nodes ({nodelist}) with scontrol")
        hosts = done.stdout.split()
        if len(hosts) < len(part.nodes):
            raise JobError(f"{self.what}: job {self.job_id} gave group {part.group.name} {len(hosts)} node(s) "
                           f"for {len(part.nodes)} agents")
        return hosts

    def _query_gres(self, hosts: list[str]) -> dict[str, str]:
        done = self._run("scontrol", "-o", "show", "node", ",".join(hosts))
        gres = {}
        for line in done.stdout.splitlines() if done is not None else []:
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            if fields.get("Gres", "(null)") != "(null)":
                gres[fields.get("NodeName", "")] = fields["Gres"]
        return gres

    def _state(self) -> str:
        done = self._run("squeue", "-h", "-j", self.job_id, "-o", "%T (%r)")
        lines = [line.strip() for line in done.stdout.splitlines() if line.strip()] if done is not None else []
        return ", ".join(dict.fromkeys(lines)) or "in an unknown state"  # one per component of a het job

    def release(self) -> None:
        """scancel the job and close salloc's stdin (its command ends, it gives the allocation up);
        SIGTERM a salloc still there (one still waiting for its allocation withdraws the request:
        SIGKILL would leave the job queued), SIGKILL only as a last resort."""
        if self.job_id is not None:  # also where salloc is gone: a job it leaves behind holds its nodes
            self._run("scancel", self.job_id)
        if self.process.poll() is not None:
            return
        if self.process.stdin is not None:
            close_quietly(self.process.stdin)
        for sig, wait_s in ((None, 5.0), (signal.SIGTERM, QUERY_TIMEOUT_S), (signal.SIGKILL, 5.0)):
            if sig is not None:
                signal_group(self.process, sig)
            try:
                self.process.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def salloc_command(components: list[Component], granted: Path) -> list[str]:
    """One salloc; a heterogeneous job's components separated by ':'. Its command makes `granted`,
    says which job and nodes (one node list per component), then holds the allocation until stdin
    closes."""
    parts = []
    for part in components:
        group = part.group
        # --no-kill: a failed node ends its own step, not the allocation; `up` declares that node lost
        # and trains on (a later --no-kill=off in salloc_options undoes it).
        options = [f"--nodes={len(part.nodes)}", f"--job-name=hetlaunch-{group.het_job or group.name}", "--no-kill"]
        for key, option in (("partition", "--partition"), ("account", "--account"),
                            ("gpus_per_node", "--gpus-per-node"), ("time", "--time")):
            if getattr(group, key) is not None:
                options.append(f"{option}={getattr(group, key)}")
        pinned = [n.host for n in part.nodes if n.host]
        if pinned:
            options.append(f"--nodelist={','.join(pinned)}")
        parts += [":"] * bool(parts) + options + group.salloc_options
    lists = (["$SLURM_JOB_NODELIST"] if len(components) == 1 else
             [f"$SLURM_JOB_NODELIST_HET_GROUP_{i}" for i in range(len(components))])
    # ($0 of both shells is `granted`, a file the command makes when the allocation starts.)
    hold = f': > "$0"; echo "{MARK} $SLURM_JOB_ID {" ".join(lists)}"; exec cat >/dev/null'
    # The command holds a granted allocation while stdin is open; a request still queued has no
    # command yet, so a shell around salloc watches stdin too and, when it closes (`up` ended or
    # was killed) before the allocation started, sends salloc SIGTERM, which withdraws the request
    # (SIGKILL of `up` left it queued). Once it started, salloc ignores SIGTERM and the command's
    # end gives the allocation up (a SIGTERM then left salloc spinning). A SIGTERM to the shell
    # (release) is passed to salloc and the shell waits on; once salloc is gone it ends what is
    # left of its group (the watcher's cat) and exits with salloc's code. (fd 3: a background
    # list's stdin is /dev/null, and dash does so even with `0<&0`.)
    # The TERM trap is set only after both children are forked: a child forked under it takes
    # the shell's handler until it resets its traps, and a TERM to the group in that moment ran
    # the handler there instead of ending it: under load 25 of 200 wrappers left the watcher and
    # its cat behind. A TERM before the trap is set ends the shell; stdin's end still withdraws.
    watch = ('exec 3<&0; "$@" <&3 & s=$!; '
             '{ cat >/dev/null; [ -e "$0" ] || kill -TERM $s 2>/dev/null; } <&3 & '
             'trap \'kill -TERM $s 2>/dev/null\' TERM; '
             'while :; do wait $s; r=$?; kill -0 $s 2>/dev/null || break; done; '
             'trap "" TERM; kill -TERM 0 2>/dev/null; exit $r')
    return ["sh", "-c", watch, str(granted), "salloc", *parts, "--", "sh", "-c", hold, str(granted)]


def salloc_errors(text: str) -> str:
    """Slurm's reasons from salloc's output, on one line (its progress lines and help hints left out)."""
    lines = [re.sub(r"^(salloc: )?(error: )?", "", line.strip()) for line in text.splitlines() if line.strip()]
    reasons = [line for line in lines if not re.match(_SALLOC_PROGRESS, line)]
    reason = "; ".join(dict.fromkeys(reasons)) or "salloc exited without a reason"
    return reason if len(reason) <= 300 else reason[:297] + "..."


_SALLOC_PROGRESS = (r"(Pending job allocation|job \d+ queued|Granted job allocation|Relinquishing job allocation|"
                    r"Waiting for resource configuration|Nodes .* are ready|Try \"salloc --help\"|" + MARK + ")")


def slurm_env() -> dict[str, str]:
    """Our environment for salloc and srun (srun passes it on to the agents), never the token, and
    none of a job's SLURM_* variables when `up` itself runs inside one (srun would take its options)."""
    env = {k: v for k, v in os.environ.items()
           if k != TOKEN_ENV_VAR and not (k.startswith("SLURM_") and k != "SLURM_CONF")}
    env["PYTHONUNBUFFERED"] = "1"
    return env
