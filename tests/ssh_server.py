"""A real OpenSSH server on 127.0.0.1 for the tests, with its own host key and a client key that
only it accepts. The tests run as root (CI does); .ci/run installs openssh-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def sshd_missing() -> str | None:
    """Why a real SSH server cannot run here, or None."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "needs OpenSSH (apt-get install openssh-server openssh-client; .ci/run does)"
    if os.geteuid() != 0:
        return "needs root (sshd logs in as the user running the tests, which must own the keys)"
    return None


@dataclass
class SshServer:
    port: int
    client_key: Path
    process: subprocess.Popen

    def options(self) -> list[str]:
        """ssh_options for a node that logs in here."""
        return ["-i", str(self.client_key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sshd(directory: Path) -> SshServer:
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True)
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory sshd insists on
    port = _free_port()
    config = directory / "sshd_config"
    config.write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {directory / 'host_key'}
AuthorizedKeysFile {directory / 'authorized_keys'}
PidFile {directory / 'sshd.pid'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
""")
    process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                               stderr=open(directory / "sshd.log", "w"))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd exited: {(directory / 'sshd.log').read_text()[-500:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return SshServer(port, directory / "client_key", process)
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("sshd did not listen within 15s")
