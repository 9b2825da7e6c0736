"""What the commands that start a cluster share (`up`, `profile`, `plan` of a YAML): the YAML
loaded, the extras and token files it asks for checked, the join token, and the work run so that
every exit path stops the agents it started. Each failure is one line and its exit code
(launcher/cli_common.py). Like launcher/cli.py, nothing heavy is imported up front.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

from hetlaunch.launcher.cli_common import EXIT_BAD_INPUT, EXIT_JOB_FAILED, fail


class Terminated(Exception):
    """SIGTERM arrived; unwinding stops every agent `up` started."""


def load_cluster_file(cluster_yaml: Path):
    from hetlaunch.launcher.config_types import ConfigError
    from hetlaunch.launcher.cluster_yaml import load_cluster

    try:
        return load_cluster(cluster_yaml)
    except ConfigError as err:
        fail(str(err), EXIT_BAD_INPUT)


def check_extras(cluster) -> None:
    """TensorBoard or Prometheus asked for and not installed: one line, before anything starts."""
    from hetlaunch.launcher import extras

    try:
        extras.check_extras(cluster)
    except extras.MissingExtra as err:
        fail(str(err), EXIT_BAD_INPUT)


def check_tls_files(cluster, cluster_yaml: Path) -> None:
    """Every PEM file coordinator.tls names is there and reads as PEM (relative names from the current
    directory, as `up` reads them), or one line: `up` would fail on it only once it starts the coordinator."""
    tls = cluster.coordinator.tls
    if tls is None:
        return
    from hetlaunch.runtime.tls import TlsError, read_pem

    for field in ("cert", "key", "ca", "agent_cert", "agent_key"):
        name = getattr(tls, field)
        if name is not None:
            try:
                read_pem(name, f"coordinator.tls.{field}")
            except TlsError as err:
                hint = "" if os.path.lexists(name) else " (make them with `hetlaunch certs init DIR`)"
                fail(f"{cluster_yaml}: {err}{hint}", EXIT_BAD_INPUT)


def check_token_files(cluster, cluster_yaml: Path, ask_entrypoint: tuple[str, ...] | None) -> str | None:
    """Every id of a token file below the model's vocabulary (launcher/token_check.py), or one line."""
    from hetlaunch.launcher.token_check import BadTokens, check_tokens

    try:
        return check_tokens(cluster, str(cluster_yaml), ask_entrypoint)
    except BadTokens as err:
        fail(str(err), EXIT_BAD_INPUT)


def new_token() -> str:
    import secrets

    return secrets.token_urlsafe(24)


def join_token(cluster, token_file: Optional[Path]) -> Optional[str]:
    """The token remote agents must present: from --token-file or $HETLAUNCH_TOKEN, else a new one later."""
    from hetlaunch.runtime.auth import read_token

    if token_file is None and not cluster.remote_nodes and cluster.discover is None:
        return None
    try:
        return read_token(str(token_file) if token_file else None)
    except ValueError as err:
        if token_file is not None:
            fail(str(err), EXIT_BAD_INPUT)
        return None  # no token given: one is generated and written to the run directory


def with_cluster(work) -> None:
    """Run work that starts agents; every exit path stops them (SIGTERM is turned into an unwind)."""
    from hetlaunch.launcher.config_types import ConfigError
    from hetlaunch.launcher.planning.plan import TilingError
    from hetlaunch.launcher.planning.planner import PlanningError
    from hetlaunch.launcher.planning.profile_file import ProfileError
    from hetlaunch.launcher.job_errors import BadInputError
    from hetlaunch.launcher.session import JobError

    def on_sigterm(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    # A closed terminal (SIGHUP) unwinds the same way: by default it killed `up` on the spot and a
    # Slurm allocation still queued was never withdrawn. Not under nohup, which ignores it on purpose.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, on_sigterm)
    try:
        work()
    except BadInputError as err:
        fail(str(err), EXIT_BAD_INPUT)
    except (JobError, PlanningError, ProfileError) as err:
        fail(str(err), EXIT_JOB_FAILED)
    except (ConfigError, TilingError) as err:  # TilingError: pinned ranges of a model only agents can count
        fail(str(err), EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        fail("interrupted; every local agent was stopped", 130)
    except Terminated:
        fail("terminated; every local agent was stopped", 143)
