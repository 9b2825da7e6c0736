"""The `hetlaunch` command: up, agent, validate."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from hetlaunch.launcher.cluster_config import ConfigError, load_cluster

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train one PyTorch model as an uneven pipeline across mixed, spread-out nodes.")
console = Console()
errors = Console(stderr=True)

EXIT_BAD_INPUT = 2
EXIT_JOB_FAILED = 1


class Terminated(Exception):
    """SIGTERM arrived; unwinding stops every agent `up` started."""


def _fail(message: str, code: int) -> None:
    errors.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def validate(cluster_yaml: Path = typer.Argument(..., help="cluster YAML file")) -> None:
    """Check a cluster YAML file without starting anything."""
    try:
        cluster = load_cluster(cluster_yaml)
    except ConfigError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    console.print(f"{cluster_yaml}: ok ({len(cluster.nodes)} nodes, {len(cluster.local_nodes)} local, "
                  f"{len(cluster.remote_nodes)} remote)")


@app.command()
def up(
    cluster_yaml: Path = typer.Argument(..., help="cluster YAML file"),
    run_dir: Optional[Path] = typer.Option(None, help="write metrics here (default: runs/<run-id>)"),
    token_file: Optional[Path] = typer.Option(None, help="join token for remote agents (default: $HETLAUNCH_TOKEN or a new one)"),
) -> None:
    """Start a coordinator and the local agents, wait for remote ones, train, write runs/<run-id>/."""
    from hetlaunch.launcher.job import JobError, UpOptions, run_up
    from hetlaunch.runtime.auth import read_token

    try:
        cluster = load_cluster(cluster_yaml)
    except ConfigError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    token = None
    if token_file is not None or cluster.remote_nodes:
        try:
            token = read_token(str(token_file) if token_file else None)
        except ValueError:
            if token_file is not None:
                _fail(f"cannot read token file {token_file}", EXIT_BAD_INPUT)
            # No token given: up generates one and writes it to the run directory for remote agents.

    def on_sigterm(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        run_up(cluster, UpOptions(run_dir=run_dir, token=token), console)
    except (JobError, ConfigError, ValueError) as err:
        _fail(str(err), EXIT_JOB_FAILED if isinstance(err, JobError) else EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        _fail("interrupted; every local agent was stopped", 130)
    except Terminated:
        _fail("terminated; every local agent was stopped", 143)


@app.command()
def agent(
    coordinator: str = typer.Option(..., help="HOST:PORT of the coordinator started by `hetlaunch up`"),
    name: str = typer.Option(..., help="this node's name in the cluster YAML"),
    token_file: Optional[Path] = typer.Option(None, help="file holding the join token (else $HETLAUNCH_TOKEN)"),
    connect_timeout: float = typer.Option(60.0, help="seconds to wait for the coordinator"),
) -> None:
    """Join a coordinator as one node of the cluster and run the stage it assigns."""
    from hetlaunch.runtime.agent import run_agent
    from hetlaunch.runtime.auth import read_token

    try:
        token = read_token(str(token_file) if token_file else None)
    except ValueError as err:
        _fail(str(err), EXIT_BAD_INPUT)
    raise typer.Exit(run_agent(coordinator, name, token, connect_timeout))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
