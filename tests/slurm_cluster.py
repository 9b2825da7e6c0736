"""A real, private Slurm cluster on this machine for tests of launch: slurm.

Debian's slurm-wlm and munge (which .ci/run installs): a munged with its own key and socket,
one slurmctld and one slurmd per emulated node (n1, n2 ... all on this host, each on its own port),
everything under a temporary directory with its own slurm.conf (SLURM_CONF points the client
commands at it). Started as root; torn down, daemons and all, by `stop`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "salloc", "srun", "scancel", "squeue", "sinfo", "scontrol")
START_TIMEOUT_S = 60.0


def slurm_missing() -> str | None:
    """Why no test Slurm can be started here (one line), or None."""
    missing = [d for d in DAEMONS if not (shutil.which(d) or Path("/usr/sbin", d).exists())]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a test Slurm cluster needs root (slurmd starts tasks as their user)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: list[str]
    partition: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *command: str, timeout: float = 20) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, env=self.env(),
                              stdin=subprocess.DEVNULL)

    def jobs(self) -> list[str]:
        """squeue: the ids of jobs pending, running or completing."""
        done = self.run("squeue", "-h", "-o", "%i %T")
        return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]

    def idle_nodes(self) -> list[str]:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        return [line.split()[0] for line in done.stdout.splitlines() if line.split()[-1:] == ["idle"]]

    def log_tail(self) -> str:
        lines = []
        for log in sorted(self.root.glob("*.log")):
            lines.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(lines)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.processes):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def start_slurm(root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 2, gpus: int = 1) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node; return once sinfo shows them idle (or raise
    RuntimeError naming what did not come up, with the daemons' log tails). Each node has `gpus`
    GPUs of type `fake` as Slurm sees them (/dev/null their device file in gres.conf): enough for
    --gpus-per-node and for Gres in `scontrol show node`, while the agents compute on CPU."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # munged refuses a socket directory others may write
    name = "t" + secrets.token_hex(3)
    cluster = SlurmCluster(root, root / "slurm.conf", list(nodes), partition="debug")
    key = root / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    socket_path = root / "munge.socket"
    ctld_port = _free_port()
    node_lines = "\n".join(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} "
                           f"CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                           + (f" Gres=gpu:fake:{gpus}" if gpus else "") for n in nodes)
    (root / "gres.conf").write_text(f"AutoDetect=off\nName=gpu Type=fake File=/dev/null Count={gpus}\n" if gpus else "")
    cluster.conf.write_text(f"""\
ClusterName={name}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket_path}
StateSaveLocation={root}/ctld-state
SlurmdSpoolDir={root}/slurmd-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
SwitchType=switch/none
GresTypes=gpu
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
{node_lines}
PartitionName={cluster.partition} Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP
""")
    env = cluster.env()
    try:
        _daemon(cluster, [_exe("munged"), "--foreground", "--force", f"--socket={socket_path}",
                          f"--key-file={key}", f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                          f"--seed-file={root}/munged.seed"], env)
        _wait(lambda: socket_path.exists(), "munged's socket", cluster)
        _daemon(cluster, [_exe("slurmctld"), "-D", "-i", "-f", str(cluster.conf)], env)
        _wait(lambda: cluster.run("scontrol", "ping").returncode == 0, "slurmctld to answer scontrol ping", cluster)
        for node in nodes:
            _daemon(cluster, [_exe("slurmd"), "-D", "-N", node, "-f", str(cluster.conf)], env)
        _wait(lambda: sorted(cluster.idle_nodes()) == sorted(nodes), f"nodes {', '.join(nodes)} idle in sinfo",
              cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _daemon(cluster: SlurmCluster, command: list[str], env: dict[str, str]) -> None:
    log = open(cluster.root / f"{Path(command[0]).name}-{len(cluster.processes)}.out", "w")
    with log:
        cluster.processes.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))


def _wait(predicate, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in cluster.processes:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(proc.args[:1])} exited with {proc.returncode} while waiting for "
                                   f"{what}\n{cluster.log_tail()}")
        try:
            if predicate():
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {START_TIMEOUT_S:g}s waiting for {what}\n{cluster.log_tail()}")
