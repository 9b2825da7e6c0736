"""`hetlaunch status | logs | down` (a running job, through its run directory) and `hetlaunch certs`.

Registered on the one `hetlaunch` app by launcher/cli.py; like it, each imports what it needs when it runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from hetlaunch.launcher.cli_common import EXIT_BAD_INPUT, EXIT_JOB_FAILED, fail, given_path
from hetlaunch.launcher.plain_text import escape_controls, plain


def status(
    run_dir: Path = typer.Argument(..., help="the run directory (runs/<id>)"),
    token_file: Optional[Path] = typer.Option(None, help="the join token (default: RUN_DIR/token)"),
) -> None:
    """Show a running job: generation, each node's state, step and last heartbeat, the last step's figures."""
    from hetlaunch.launcher.run_control import NotARun, RunControlError, last_record
    from hetlaunch.launcher.run_control import status as run_status

    try:
        reply = run_status(run_dir, token_file)
    except RunControlError as err:  # not a run: bad input; a run that ended or does not answer: the job's
        fail(str(err), EXIT_BAD_INPUT if isinstance(err, NotARun) else EXIT_JOB_FAILED)
    last = last_record(run_dir)
    print(f"{escape_controls(str(run_dir))}: generation {reply.generation}"
          + (f", stopping: {reply.down_requested}" if reply.down_requested else ""))
    if last is not None:  # a line of metrics.jsonl as written, or one a hand changed: said as it is
        step, loss, tokens = (last.get(k) for k in ("step", "loss", "tokens_per_s"))
        rate = f"{tokens:,.0f} tokens/s" if isinstance(tokens, (int, float)) else "tokens/s unknown"
        print(plain(f"  step {step}, loss {loss}, {rate}"))
    for node in reply.nodes:
        print(f"  {node.node:<24} {node.state:<10} step {node.step:<8} heard {node.silent_s:.1f}s ago")


def logs(
    run_dir: Path = typer.Argument(..., help="the run directory (runs/<id>)"),
    node: str = typer.Argument(..., help="a node name"),
    follow: bool = typer.Option(False, "-f", "--follow", help="keep printing until the run ends"),
) -> None:
    """Print an agent's log: those `up` started (local, ssh, Slurm, Ray) log into the run directory;
    `launch: remote` agents and Kubernetes pods log on their own host."""
    from hetlaunch.launcher.run_control import RunControlError, contact_of, follow_log

    from hetlaunch.launcher.config_types import NAME_RE

    if not NAME_RE.fullmatch(node):  # as the YAML's names: `../x` read outside logs/
        fail(f"{node!r} is not a node name", EXIT_BAD_INPUT)
    if not run_dir.is_dir():  # said "no log for node" of a folder that is not there (a hostile review)
        fail(f"{run_dir}: not a run directory (no such folder)", EXIT_BAD_INPUT)
    path = run_dir / "logs" / f"{node}.log"
    if path.is_symlink():  # a run directory handed over could point a log at any file of the reader's
        fail(f"{path}: a link, not a log `up` wrote", EXIT_BAD_INPUT)
    if not path.is_file():
        fail(f"{path}: no log for node {node!r} in this run (a remote agent logs on its own host)", EXIT_BAD_INPUT)
    try:
        contact = contact_of(run_dir) if follow else None
    except RunControlError as err:
        fail(str(err), EXIT_BAD_INPUT)
    try:
        follow_log(path, contact, sys.stdout)
    except RunControlError as err:
        fail(str(err), EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        raise typer.Exit(130)


def down(
    run_dir: Path = typer.Argument(..., help="the run directory (runs/<id>)"),
    reason: str = typer.Option("hetlaunch down", help="recorded in events.jsonl"),
    token_file: Optional[Path] = typer.Option(None, help="the join token (default: RUN_DIR/token)"),
) -> None:
    """Stop a running job at its next committed checkpoint (at once when checkpoints are off); up --resume continues it."""
    from hetlaunch.launcher.run_control import NotARun, RunControlError
    from hetlaunch.launcher.run_control import down as run_down

    try:
        run_down(run_dir, reason, token_file)
    except RunControlError as err:  # as status
        fail(str(err), EXIT_BAD_INPUT if isinstance(err, NotARun) else EXIT_JOB_FAILED)
    print(f"{escape_controls(str(run_dir))}: stopping at the next committed checkpoint (at once where checkpoints are "
          "off)", flush=True)


certs_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Certificates for TLS on the control plane (needs cryptography: the tls extra).")


@certs_app.command("init")
def certs_init(
    directory: str = typer.Argument(..., help="where the CA, coordinator and agent certificates go"),
    host: list[str] = typer.Option([], "--host", help="an address agents dial the coordinator at (repeat)"),
) -> None:
    """Make a private CA, a coordinator certificate (localhost, 127.0.0.1, ::1 and each --host) and an agent certificate."""
    from hetlaunch.launcher.certs import CertError, init_certs

    try:
        issued = init_certs(given_path(directory, "DIRECTORY"), host)
    except CertError as err:
        fail(str(err), EXIT_BAD_INPUT)
    except OSError as err:
        fail(f"{err.filename or directory}: {err.strerror or err}", EXIT_BAD_INPUT)
    shown = escape_controls(str(directory))  # a folder named with escape sequences is printed, not obeyed
    print(f"{shown}: {', '.join(issued.files)} (coordinator valid for {', '.join(issued.hosts)}). In the cluster YAML:\n"
          f"  coordinator: {{tls: {{cert: {shown}/coordinator.pem, key: {shown}/coordinator.key, "
          f"ca: {shown}/ca.pem, agent_cert: {shown}/agent.pem, agent_key: {shown}/agent.key}}}}\n"
          f"On each remote host: hetlaunch agent ... --ca ca.pem --cert agent.pem --key agent.key "
          f"(keep ca.key off the hosts)", flush=True)
