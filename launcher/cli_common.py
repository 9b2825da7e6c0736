"""What every `hetlaunch` command shares: exit codes, plain-text consoles, the one-line error."""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import typer

from hetlaunch.launcher.config_types import home_path
from hetlaunch.launcher.plain_text import escape_controls

EXIT_BAD_INPUT = 2
EXIT_JOB_FAILED = 1


def plain_console(stderr: bool = False):
    """Plain-text output: markup off, so no user or error text is ever altered or breaks printing.
    A pipe or a log file gets lines wide enough for the plan table; a terminal keeps its own width."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, markup=False, emoji=False, highlight=False,
                   width=None if stream.isatty() else 120)


def fail(message: str, code: int) -> None:
    # A message may quote a file (a profile's key, a model description): its escape sequences escaped.
    print(f"error: {escape_controls(' '.join(str(message).split()))}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def interrupt_on_sigterm() -> None:
    """SIGTERM unwinds as Ctrl-C does (KeyboardInterrupt, exit 130): a command writing a file
    removes its temp file on the way out, where SIGTERM's default left it behind (gigabytes, for
    prepare-data of a large corpus; a hostile review)."""
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)


def output_file(raw: str, example: str) -> Path:
    """The file an -o names, or one line (exit 2) where writing it would not do what was asked:
    an empty name (it became "."), a folder ("out/" lost its slash and became a file "out"), or
    something that is not a regular file (a FIFO or /dev/null would be replaced by the file
    renamed over it). Checked before any work, not after minutes of it."""
    path = given_path(raw, "-o")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:  # a name too long, a loop of links, a file where a folder should be
        fail(f"cannot write {raw}: {err.strerror or err}", EXIT_BAD_INPUT)
    if raw.endswith(("/", os.sep)) or (mode is not None and stat.S_ISDIR(mode)):
        fail(f"{raw}: names a folder; give the file's name (e.g. {path / example})", EXIT_BAD_INPUT)
    if mode is not None and not stat.S_ISREG(mode):
        fail(f"{raw} exists and is not a regular file", EXIT_BAD_INPUT)
    return path


def given_path(raw: str, what: str) -> Path:
    """A path from the command line, refused in one line when empty: Path("") is ".", and an empty
    -o (an unset shell variable) wrote into the current directory. `~` is the user's home, as in
    the YAML: a quoted '~/x.bin' was written into a folder named ~ while the YAML line printed for it
    read the home's (a hostile review)."""
    if not raw:
        fail(f"{what}: an empty path (give '.' for the current directory)", EXIT_BAD_INPUT)
    try:
        return home_path(raw)
    except ValueError as err:
        fail(f"{what} {err}", EXIT_BAD_INPUT)
