"""A geo cluster in the kernel: network namespaces joined by veth pairs, the cross-region pair
shaped with tc (tbf: bandwidth only; netem is not in every kernel). Used by the multi-host test
and `bench/real_links.py`. Root only; every address is inside namespaces made here.

    coordinator ns  --ctl0/10.231.1.0/24--  region-a ns  --dp0 (shaped)--  region-b ns
                    --ctl0/10.231.2.0/24--------------------------------/

Each agent namespace has a control interface to the coordinator (ctl0) and the data interface
(dp0) between them; the two are not routed into each other, so a data plane that is not bound
to dp0 cannot reach its peer.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

COORDINATOR_ADDRESSES = {"a": "10.231.1.1", "b": "10.231.2.1"}  # what each agent dials
PORT = 29555  # the coordinator's: fixed, the namespaces are ours alone
DATA_ADDRESSES = {"a": "10.232.0.1", "b": "10.232.0.2"}


def netns_missing() -> str | None:
    """Why this machine cannot make namespaces, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = f"hlprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()[:120]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@dataclass
class GeoNamespaces:
    """Three namespaces: `coordinator`, `a`, `b`; the a-b data link shaped to `mbit` (None: unshaped)."""
    mbit: float | None
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))

    def name(self, role: str) -> str:
        return f"hl{role[0]}{self.suffix}"

    def exec(self, role: str) -> list[str]:
        """The command prefix that runs a program inside a namespace."""
        return ["ip", "netns", "exec", self.name(role)]

    def __enter__(self) -> "GeoNamespaces":
        try:
            for role in ("coordinator", "a", "b"):
                _ip("ip", "netns", "add", self.name(role))
                _ip("ip", "link", "set", "lo", "up", ns=self.name(role))
            c = self.name("coordinator")
            for role, net in (("a", "10.231.1"), ("b", "10.231.2")):
                outside = f"c{role}{self.suffix}"
                _ip("ip", "link", "add", outside, "netns", c, "type", "veth", "peer", "name", "ctl0",
                    "netns", self.name(role))
                _ip("ip", "addr", "add", f"{net}.1/24", "dev", outside, ns=c)
                _ip("ip", "link", "set", outside, "up", ns=c)
                _ip("ip", "addr", "add", f"{net}.2/24", "dev", "ctl0", ns=self.name(role))
                _ip("ip", "link", "set", "ctl0", "up", ns=self.name(role))
            _ip("ip", "link", "add", "dp0", "netns", self.name("a"), "type", "veth", "peer", "name", "dp0",
                "netns", self.name("b"))
            for role in ("a", "b"):
                ns = self.name(role)
                _ip("ip", "addr", "add", f"{DATA_ADDRESSES[role]}/24", "dev", "dp0", ns=ns)
                _ip("ip", "link", "set", "dp0", "up", ns=ns)
                if self.mbit is not None:  # each direction shaped where it leaves its namespace
                    _ip("tc", "qdisc", "add", "dev", "dp0", "root", "tbf", "rate", f"{self.mbit}mbit",
                        "burst", "64kb", "latency", "400ms", ns=ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for role in ("coordinator", "a", "b"):  # deleting a namespace deletes its veth ends with it
            subprocess.run(["ip", "netns", "del", self.name(role)], capture_output=True)


def start_in_namespaces(geo: GeoNamespaces, workdir: Path, cluster_yaml: str, env: dict,
                        agent_args: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """`hetlaunch up` in the coordinator's namespace (the YAML must bind 0.0.0.0:PORT) and a
    remote agent named `a` and `b` in each region's (with `agent_args`, e.g. TLS files):
    (processes, their log files) by name."""
    token = workdir / "token"
    token.write_text(f"netns-{secrets.token_hex(8)}\n")
    (workdir / "c.yaml").write_text(cluster_yaml)
    cli = [sys.executable, "-m", "hetlaunch.launcher.cli"]
    logs = {name: open(workdir / f"{name}.log", "w+") for name in ("up", "a", "b")}
    commands = {"up": geo.exec("coordinator") + cli + ["up", str(workdir / "c.yaml"), "--run-dir", str(workdir / "run"),
                                                       "--token-file", str(token)]}
    for n in ("a", "b"):
        commands[n] = geo.exec(n) + cli + ["agent", "--coordinator", f"{COORDINATOR_ADDRESSES[n]}:{PORT}", "--name", n,
                                           "--token-file", str(token), "--connect-timeout", "30", *agent_args,
                                           *(() if "--ca" in agent_args else ("--insecure",))]  # as coordinator.insecure
    procs = {name: subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logs[name], stderr=subprocess.STDOUT, env=env)
             for name, cmd in commands.items()}
    return procs, logs


def finish_in_namespaces(procs: dict, logs: dict, timeout_s: float) -> tuple[int | None, str]:
    """Wait for `up` (at most timeout_s), then end every process: (up's exit code, every log's tail)."""
    try:
        procs["up"].wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = ""
    for name, log in logs.items():
        log.seek(0)
        text += f"--- {name}\n{log.read()[-3000:]}"
        log.close()
    return procs["up"].returncode, text


def run_in_namespaces(geo: GeoNamespaces, workdir: Path, cluster_yaml: str, env: dict,
                      timeout_s: float = 150, agent_args: tuple[str, ...] = ()) -> tuple[int | None, str]:
    """start_in_namespaces, then finish_in_namespaces. Leaves no process behind."""
    procs, logs = start_in_namespaces(geo, workdir, cluster_yaml, env, agent_args)
    return finish_in_namespaces(procs, logs, timeout_s)


def set_data_link(geo: GeoNamespaces, up: bool) -> None:
    """Cut (or restore) the data link between the regions, at region a's end."""
    _ip("ip", "link", "set", "dp0", "up" if up else "down", ns=geo.name("a"))
