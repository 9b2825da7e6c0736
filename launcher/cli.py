"""The `hetlaunch` command: up, status, logs, down, profile, plan, validate, prepare-data, export, certs, agent.

Only typer is imported up front: each command imports what it needs, so `--help`,
`--version` and `validate` never load torch or grpc (but for `validate` asking an entrypoint
model its vocabulary, to check a token file's ids). Every message is printed as plain
text (never parsed as rich markup: a node's error may contain `[...]`), errors as one
line `error: ...` on stderr with the exit code below.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from hetlaunch.launcher.cli_cluster import (check_extras, check_tls_files, check_token_files, join_token,
                                            load_cluster_file, new_token, with_cluster)
from hetlaunch.launcher.cli_common import (EXIT_BAD_INPUT, fail, given_path, interrupt_on_sigterm, output_file,
                                          plain_console)
from hetlaunch.launcher.plain_text import escape_controls
from hetlaunch.launcher.cli_plan import plan
from hetlaunch.launcher.cli_run_commands import certs_app, down, logs, status

# gRPC's C core logs its own copy of an error (a failed bind, say) to stderr before Python sees it;
# the user gets our one line instead. GRPC_VERBOSITY=debug in the environment brings the logs back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Train one PyTorch model as an uneven pipeline across mixed, spread-out nodes.")


def _show_version(value: bool) -> None:
    if value:
        from hetlaunch.runtime.version import hetlaunch_version

        print(f"hetlaunch {hetlaunch_version()}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_show_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """Train one PyTorch model as an uneven pipeline across mixed, spread-out nodes."""


@app.command()
def validate(cluster_yaml: Path = typer.Argument(..., help="cluster YAML file"),
             allow_entrypoint: list[str] = typer.Option([], help="fnmatch pattern of model entrypoints validate may "
                                                       "import to check a token file against their vocabulary "
                                                       "(hetlaunch.models.* always; a YAML can name any code)")) -> None:
    """Check a cluster YAML file without starting anything."""
    cluster = load_cluster_file(cluster_yaml)
    check_extras(cluster)
    check_tls_files(cluster, cluster_yaml)
    tokens = check_token_files(cluster, cluster_yaml, ask_entrypoint=tuple(allow_entrypoint))
    slurm = sum(n.launch == "slurm" for n in cluster.nodes)
    on_ray = sum(n.launch == "ray" for n in cluster.nodes)
    print(f"{escape_controls(str(cluster_yaml))}: ok ({len(cluster.nodes)} nodes, {len(cluster.local_nodes)} local, "
          f"{len(cluster.remote_nodes)} remote, {len(cluster.ssh_nodes)} over ssh"
          f"{f', {slurm} by slurm' if slurm else ''}{f', {on_ray} on Ray' if on_ray else ''})", flush=True)
    if tokens:
        print(f"  {tokens}", flush=True)
    if cluster.discover is not None:
        print(f"  up will take {cluster.discover.describe()}", flush=True)
    if cluster.train.outer is not None:
        print(f"  {_islands_line(cluster)}", flush=True)


def _islands_line(cluster) -> str:
    """What train.outer makes of this YAML's nodes, for `validate`."""
    from hetlaunch.launcher.planning.islands import island_groups

    outer = cluster.train.outer
    groups = island_groups(outer.islands, [(n.name, n.region) for n in cluster.nodes])
    how = "one per region" if outer.islands == "by_region" else "as listed"
    if len(groups) < 2:
        return (f"train.outer: the nodes form one island ({how}), so training is synchronous: every step syncs "
                f"across all pipelines and no outer step is taken")
    every = "H chosen by the planner" if outer.every == "auto" else f"every {outer.every} steps"
    return (f"train.outer: {len(groups)} islands ({how}): " + "; ".join(f"[{', '.join(g)}]" for g in groups)
            + f" — each syncs every step inside itself; outer steps {every}, {outer.codec} deltas"
            + (f", {outer.fragments} fragments in turn" if outer.fragments > 1 else "")
            + "; not step-for-step synchronous training (README: Islands)")


@app.command()
def up(
    cluster_yaml: Path = typer.Argument(..., help="cluster YAML file"),
    run_dir: Optional[Path] = typer.Option(None, help="write metrics here (default: runs/<run-id>)"),
    token_file: Optional[Path] = typer.Option(None, help="join token for remote agents (default: $HETLAUNCH_TOKEN or a new one)"),
    reprofile: bool = typer.Option(False, help="measure every node again instead of using cached profiles"),
    resume: Optional[Path] = typer.Option(None, help="continue the run in this run directory from its last "
                                                     "committed checkpoint (same YAML)"),
) -> None:
    """Start a coordinator and the local agents, wait for remote ones, profile, plan, train, write runs/<run-id>/."""
    cluster = load_cluster_file(cluster_yaml)
    check_extras(cluster)
    check_token_files(cluster, cluster_yaml, ask_entrypoint=None)  # an entrypoint's vocabulary: the stages check
    token = join_token(cluster, token_file)
    if resume is not None and run_dir is not None and resume.resolve() != run_dir.resolve():
        fail("--resume continues in its own run directory; leave --run-dir out", 2)
    from hetlaunch.launcher.job_driver import UpOptions, run_up

    options = UpOptions(run_dir=run_dir, token=token, source=cluster_yaml, reprofile=reprofile, resume=resume)
    with_cluster(lambda: run_up(cluster, options, plain_console()))


@app.command()
def profile(
    cluster_yaml: Path = typer.Argument(..., help="cluster YAML file"),
    output_name: str = typer.Option(..., "-o", "--output", help="where to write the profile JSON"),
    run_dir: Optional[Path] = typer.Option(None, help="agent logs go here (default: runs/<run-id>)"),
    token_file: Optional[Path] = typer.Option(None, help="join token for remote agents"),
    reprofile: bool = typer.Option(False, help="measure every node again instead of using cached profiles"),
) -> None:
    """Start the cluster's agents, measure nodes and links, save the profile; train nothing."""
    cluster = load_cluster_file(cluster_yaml)
    token = join_token(cluster, token_file)
    output = output_file(output_name, "profile.json")
    directory = output.parent
    why = (f"no directory {directory}" if not directory.is_dir()
           else f"{directory} is not writable" if not os.access(directory, os.W_OK) else None)
    if why:  # find out now, not after minutes of measuring
        fail(f"cannot write {output}: {why}", EXIT_BAD_INPUT)
    from hetlaunch.launcher.cluster_measurement import measure_for_train
    from hetlaunch.launcher.job_driver import UpOptions, new_run_dir
    from hetlaunch.launcher.planning.profile_file import save_profile
    from hetlaunch.launcher.session import ClusterSession

    options = UpOptions(run_dir=run_dir, token=token)
    console = plain_console()

    def measure():
        with ClusterSession(cluster, new_run_dir(cluster, options), options.token or new_token(), console) as s:
            measured = measure_for_train(s, cluster.model.to_spec(), reprofile, console)
        save_profile(measured, output)
        console.print(f"profile of {len(measured.nodes)} nodes and {len(measured.links)} links written to {output}")

    with_cluster(measure)


app.command()(plan)  # launcher/cli_plan.py


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="a run directory (runs/<run-id>)"),
    output_name: Optional[str] = typer.Option(None, "-o", "--output", help="where the PNGs go (default: RUN_DIR/report)"),
) -> None:
    """Draw a run: loss and tokens/s with its events, the plan, and each stage's predicted vs measured
    compute and communication, as PNGs (needs matplotlib: the plots extra)."""
    from hetlaunch.launcher.report import ReportError, make_report

    interrupt_on_sigterm()  # a PNG being written is removed on the way out, as on Ctrl-C
    output = None if output_name is None else given_path(output_name, "-o")
    try:
        written = make_report(run_dir, output)
    except ReportError as err:
        fail(str(err), EXIT_BAD_INPUT)
    for path in written:
        print(escape_controls(str(path)), flush=True)


@app.command("prepare-data")
def prepare_data(
    text_file: Path = typer.Argument(..., help="UTF-8 text to tokenize"),
    tokenizer: str = typer.Option(..., help="a tokenizer.json (or a directory holding one), or a Hugging Face hub name such as gpt2 (needs the network)"),
    output_name: str = typer.Option(..., "-o", "--output", help="the token file to write (e.g. train.bin)"),
) -> None:
    """Tokenize a text file into a token file for `data: {format: tokens}` (needs tokenizers: the data extra)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from hetlaunch.launcher.prepare_data import PrepareError, prepare

    output = output_file(output_name, "train.bin")
    interrupt_on_sigterm()
    try:
        total = text_file.stat().st_size if text_file.is_file() else None
        with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=plain_console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as progress:
            task = progress.add_task("tokenizing", total=total)
            done = prepare(text_file, tokenizer, output, advance=lambda n: progress.advance(task, n))
    except PrepareError as err:
        fail(str(err), EXIT_BAD_INPUT)
    except OSError as err:
        fail(f"{err.filename or output}: {err.strerror or err}", EXIT_BAD_INPUT)
    shown = escape_controls(str(output))  # a name with escape sequences is printed, not obeyed
    # quoted (a JSON string is a YAML one): a path with ", " or " #" in it gave a line that read back
    # as something else or not at all (a review)
    quoted = escape_controls(json.dumps(str(output), ensure_ascii=False))
    print(f"{shown}: {done.tokens:,} tokens as {done.dtype}, vocabulary {done.vocab_size:,}. In the cluster YAML:\n"
          f"  data: {{format: tokens, path: {quoted}, dtype: {done.dtype}}}\n"
          f"  model: {{vocab_size: {done.vocab_size}}}   # or your entrypoint's vocabulary", flush=True)


@app.command()
def export(
    run: Path = typer.Argument(..., help="a run directory, a checkpoint root, or one step-<k> checkpoint"),
    output_name: str = typer.Option(..., "-o", "--output", help="a .safetensors file, or a directory: model.safetensors "
                                                                "+ config.json (HF models) for from_pretrained"),
    allow_entrypoint: list[str] = typer.Option([], help="fnmatch pattern of model entrypoints the checkpoint may "
                                                        "name (default: hetlaunch's own models only); repeatable"),
) -> None:
    """Merge a run's newest checkpoint into one state dict (Hugging Face names, and config.json, for HF models)."""
    from hetlaunch.launcher.export import ExportError, export as export_run

    output = given_path(output_name, "-o")
    interrupt_on_sigterm()
    try:
        done = export_run(run, output, tuple(allow_entrypoint))
    except ExportError as err:
        fail(str(err), EXIT_BAD_INPUT)
    except (ValueError, TypeError) as err:  # the model's entrypoint refused (e.g. transformers missing)
        fail(str(err), EXIT_BAD_INPUT)
    except OSError as err:
        fail(f"{err.filename or output}: {err.strerror or err}", EXIT_BAD_INPUT)
    for step, why in done.skipped:
        print(escape_controls(f"skipped the checkpoint of step {step}, not intact: {why}"), flush=True)
    written = escape_controls(f"{done.weights}" + (f" and {done.config.name}" if done.config else ""))
    print(f"{written}: {done.tensors} tensors of the checkpoint at step {done.step} "
          f"({escape_controls(str(done.directory))})", flush=True)


@app.command()
def agent(
    coordinator: str = typer.Option(..., help="HOST:PORT of the coordinator started by `hetlaunch up`"),
    name: str = typer.Option(..., help="this node's name in the cluster YAML"),
    token_file: Optional[Path] = typer.Option(None, help="file holding the join token (else $HETLAUNCH_TOKEN)"),
    connect_timeout: float = typer.Option(60.0, help="seconds to wait for the coordinator"),
    work_dir: Optional[Path] = typer.Option(None, help="where checkpoint parts wait for their upload to the "
                                                       "coordinator (default ~/.cache/hetlaunch/agent/NAME)"),
    allow_entrypoint: list[str] = typer.Option([], help="fnmatch pattern of model entrypoints this agent runs, "
                                                        "e.g. 'mypkg.*:build' (repeat; default: only the built-in GPT)"),
    data_root: list[Path] = typer.Option([], help="data files may only come from under this directory (repeat)"),
    checkpoint_root: list[Path] = typer.Option([], help="checkpoints may only be written or read under this "
                                                        "directory (repeat; the work dir is always allowed)"),
    serve: bool = typer.Option(False, "--serve", help="stay up: serve one job after another, dialing the coordinator "
                                                      "again (with backoff) until SIGTERM/SIGINT"),
    ca: Optional[Path] = typer.Option(None, help="TLS: the CA that signed the coordinator's certificate"),
    cert: Optional[Path] = typer.Option(None, help="mutual TLS: this agent's certificate"),
    key: Optional[Path] = typer.Option(None, help="mutual TLS: this agent's private key"),
    region: str = typer.Option("", help="this node's region (used when the YAML discovers agents)"),
    label: list[str] = typer.Option([], help="KEY=VALUE the YAML's discover.labels can match (repeat)"),
    insecure: bool = typer.Option(False, "--insecure", help="without --ca, dial a coordinator on another machine "
                                                            "in clear text (as the YAML's coordinator.insecure)"),
) -> None:
    """Join a coordinator as one node of the cluster and run the stages it assigns, in worker subprocesses."""
    import math
    import re

    if not (math.isfinite(connect_timeout) and 0 < connect_timeout <= 365 * 86400):  # 1e10 s overflowed a deadline
        fail(f"--connect-timeout must be a positive number of seconds, at most a year (got {connect_timeout})",
             EXIT_BAD_INPUT)
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", coordinator)
    if match is None or not 0 < int(match.group(2)) < 65536:
        fail(f"--coordinator must be HOST:PORT (e.g. 10.0.0.5:29400 or [::1]:29400), not {coordinator!r}",
              EXIT_BAD_INPUT)
    from hetlaunch.launcher.config_types import NAME_RE
    from hetlaunch.runtime.agent import run_agent, tls_credentials
    from hetlaunch.runtime.auth import read_token
    from hetlaunch.runtime.labels import parse_labels

    try:
        token = read_token(str(token_file) if token_file else None)
        credentials = tls_credentials(*(str(p) if p else None for p in (ca, cert, key)), coordinator, insecure)
        labels = parse_labels(label)
    except ValueError as err:
        fail(str(err), EXIT_BAD_INPUT)
    for flag, value in (("--name", name), ("--region", region)):  # as the YAML's names (a newline split lines)
        if (value or flag == "--name") and not NAME_RE.fullmatch(value):
            fail(f"{flag} must be 1-64 of letters, digits, '_', '.', '-', starting with a letter or digit "
                 f"(got {value[:80]!r})", EXIT_BAD_INPUT)
    raise typer.Exit(run_agent(coordinator, name, token, connect_timeout, work_dir=work_dir, credentials=credentials,
                               allow_entrypoints=tuple(allow_entrypoint), data_roots=tuple(map(str, data_root)),
                               checkpoint_roots=tuple(map(str, checkpoint_root)), serve=serve, region=region,
                               labels=labels))


deploy_app = typer.Typer(no_args_is_help=True, help="Render what runs agents elsewhere, for that system to apply.")


@deploy_app.command("k8s")
def deploy_k8s(
    cluster_yaml: Path = typer.Argument(..., help="cluster YAML file with a kubernetes: section"),
    output_name: str = typer.Option(..., "-o", "--output", help="directory for the manifests (made if missing)"),
    token_file: Optional[Path] = typer.Option(None, help="join token for the Secret (default: $HETLAUNCH_TOKEN, "
                                                         "else a new one written to OUTPUT/token)"),
) -> None:
    """Render Kubernetes manifests that run the YAML's node groups as agents (kubectl apply -f OUTPUT)."""
    from hetlaunch.launcher.plain_text import escape_controls
    from hetlaunch.launcher.providers.kubernetes_deploy import DeployError, deploy

    output = given_path(output_name, "-o")
    cluster = load_cluster_file(cluster_yaml)
    try:
        done = deploy(cluster, output, token_file, str(cluster_yaml))
    except DeployError as err:
        fail(str(err), EXIT_BAD_INPUT)
    for path in done.written:
        print(escape_controls(str(path)) + (" (overwritten)" if path in done.overwritten else ""), flush=True)
    out, source = escape_controls(str(output)), escape_controls(str(cluster_yaml))
    if done.others:
        print(f"note: kubectl apply -f {out} also applies files this render did not write: "
              f"{', '.join(escape_controls(p.name) for p in done.others)}", flush=True)
    token = f" --token-file {escape_controls(str(done.new_token))}" if done.new_token else " (with the same token)"
    print(f"next: kubectl apply -f {out} && hetlaunch up {source}{token}", flush=True)


app.add_typer(deploy_app, name="deploy")
for command in (status, logs, down):
    app.command()(command)
app.add_typer(certs_app, name="certs")


def main() -> None:
    """Run the CLI and exit with its status, as typer's own entry point does (callers such as
    `python -c "...; main()"` rely on the exit); a usage error (missing argument, unknown option,
    a value of the wrong type) is one line on stderr and status 2, not typer's framed box."""
    sys.exit(_run())


def _run() -> int:
    try:  # typer 0.2x carries its own copy of click; older ones use click itself
        from typer._click import exceptions as click_errors
    except ImportError:
        from click import exceptions as click_errors

    try:
        result = app(standalone_mode=False, prog_name="hetlaunch")
    except getattr(click_errors, "NoArgsIsHelpError", ()) as error:  # `hetlaunch` alone: the help (click >= 8.2)
        typer.echo(error.format_message())
        return error.exit_code
    except click_errors.UsageError as error:
        command = error.ctx.command_path if error.ctx else "hetlaunch"
        message = " ".join(error.format_message().split())  # click wraps long messages over lines
        typer.echo(f"error: {command}: {message} (see '{command} --help')", err=True)
        return error.exit_code
    except click_errors.ClickException as error:
        typer.echo(f"error: {' '.join(error.format_message().split())}", err=True)
        return error.exit_code
    except typer.Abort:  # Ctrl-C or end of input at a prompt (typer's own class in typer 0.2x, click's before)
        typer.echo("error: aborted", err=True)
        return 130
    except OSError as error:
        if error.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
            raise
        # A path given on the command line that no file system can open: one line wherever the
        # command first touched it (report, logs, deploy -o, --run-dir, --token-file...), not a traceback.
        typer.echo(f"error: {escape_controls(str(error.filename))[:300]}: {error.strerror}", err=True)
        return EXIT_BAD_INPUT
    except RuntimeError as error:
        if not str(error).startswith("Symlink loop"):  # pathlib's resolve() on a loop of links (Python < 3.13)
            raise
        typer.echo(f"error: {escape_controls(str(error))[:300]}", err=True)
        return EXIT_BAD_INPUT
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    main()
