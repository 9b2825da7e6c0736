"""`hetlaunch status`, `logs` and `down`: see and stop a running job from its run directory.

The run dir holds what it takes to reach the job's coordinator: `coordinator.json` (address,
pid, and the TLS files' paths when the control plane uses TLS) and `token` (0600). Every call is
an authenticated RPC on the control plane, as an agent's are.
"""

from __future__ import annotations

import codecs
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil

from hetlaunch.launcher.plain_text import plain
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.protos import control_pb2_grpc
from hetlaunch.runtime.auth import TOKEN_METADATA_KEY, read_token
from hetlaunch.runtime.files import UnreadableFile, open_regular_file, read_json


class RunControlError(Exception):
    """The run cannot be reached or read, said in one line."""


class NotARun(RunControlError):
    """What was handed in is not a run directory, or one of its files (coordinator.json, the token,
    the TLS files, a log) cannot be read: bad input (exit 2), where a run that has ended or a
    coordinator that does not answer is the job's (exit 1)."""


@dataclass
class Contact:
    address: str
    pid: int
    tls: dict
    written: float = float("inf")  # when coordinator.json was written (its mtime)


MAX_CONTACT_BYTES = 1 << 16
# psutil's start times are rounded to the clock tick, and file times to the file system's
START_SLACK_S = 1.0
LOG_READ_BYTES = 1 << 20  # `logs` prints a log a MiB at a time


def contact_of(run_dir: Path) -> Contact:
    path = run_dir / "coordinator.json"
    try:  # bounded and never blocking (a FIFO or /dev/zero in its place hung status and logs)
        data = read_json(path, MAX_CONTACT_BYTES)
        contact = Contact(str(data["address"]), int(data["pid"]), dict(data.get("tls") or {}), path.stat().st_mtime)
        if contact.tls and not (isinstance(contact.tls.get("ca"), str) and all(
                isinstance(contact.tls.get(k), (str, type(None))) for k in ("cert", "key"))):
            raise ValueError("its tls entry does not name a ca (and cert and key) file")
    except FileNotFoundError:
        raise NotARun(f"{run_dir}: not a run directory (no coordinator.json)") from None
    except UnreadableFile as err:
        raise NotARun(f"{path}: unreadable ({err})") from None
    except (ValueError, KeyError, TypeError, OverflowError) as err:  # OverflowError: a pid of 1e400
        raise NotARun(f"{path}: unreadable ({type(err).__name__}: {str(err)[:100]})") from None
    if not 0 < contact.pid < 1 << 22:  # the kernel's pid_max at most; 10**30 ended os.kill in a traceback
        raise NotARun(f"{path}: unreadable (pid {str(contact.pid)[:30]} is not a process id)")
    return contact


def running(contact: Contact) -> bool:
    """Whether the run's coordinator still runs: its pid is taken by a process that started before
    coordinator.json was written. A stale run directory's pid, taken by a process started since (after
    a reboot, or once pids wrapped), kept `logs -f` following forever (a hostile review)."""
    try:
        os.kill(contact.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        started = psutil.Process(contact.pid).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # another user's process: it may be the coordinator
    return started <= contact.written + START_SLACK_S


def _stub(run_dir: Path, token_file: Path | None):
    if token_file is not None and not token_file.exists():  # it fell back to $HETLAUNCH_TOKEN without a word
        raise NotARun(f"--token-file {token_file}: no such file")
    contact = contact_of(run_dir)
    if not running(contact):
        summary = run_dir / "summary.json"
        where = (f"see {summary}" if summary.is_file() else
                 f"it wrote no summary.json: it was stopped before its end; see {run_dir / 'events.jsonl'}, "
                 f"or continue it with `hetlaunch up <its cluster YAML> --resume {run_dir}`")
        raise RunControlError(f"{run_dir}: its coordinator (pid {contact.pid}) is not running; the run has ended ({where})")
    path = token_file or (run_dir / "token")
    try:
        token = read_token(str(path)) if path.exists() else read_token(None)
    except ValueError as err:
        raise NotARun(str(err)) from None
    if contact.tls:
        from hetlaunch.runtime.tls import ClientTls, read_pem

        # named as coordinator.json names them: ClientTls.read's "--ca" is the agent's flag, which
        # status and down do not have (a hostile review)
        named = {k: contact.tls.get(k) for k in ("ca", "cert", "key")}
        try:
            if (named["cert"] is None) != (named["key"] is None):
                raise ValueError(f"{run_dir / 'coordinator.json'}: tls.cert and tls.key go together")
            pems = {k: read_pem(v, f"{run_dir / 'coordinator.json'}: tls.{k}") if v else b"" for k, v in named.items()}
            channel = grpc.secure_channel(contact.address, ClientTls(pems["ca"], pems["cert"], pems["key"]).credentials())
        except ValueError as err:
            raise NotARun(str(err)) from None
    else:
        channel = grpc.insecure_channel(contact.address)
    return control_pb2_grpc.CoordinatorStub(channel), ((TOKEN_METADATA_KEY, token),), channel


def status(run_dir: Path, token_file: Path | None = None) -> pb.GetStatusResponse:
    stub, metadata, channel = _stub(run_dir, token_file)
    try:
        return stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=10)
    except grpc.RpcError as err:
        raise _unanswered(run_dir, err) from None
    finally:
        channel.close()


def down(run_dir: Path, reason: str, token_file: Path | None = None) -> None:
    stub, metadata, channel = _stub(run_dir, token_file)
    try:
        stub.Down(pb.DownRequest(reason=reason), metadata=metadata, timeout=10)
    except grpc.RpcError as err:
        raise _unanswered(run_dir, err) from None
    finally:
        channel.close()


def _unanswered(run_dir: Path, err: grpc.RpcError) -> RunControlError:
    """A coordinator that refused the token or certificate handed in (bad input), or did not answer."""
    address = contact_of(run_dir).address
    if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return NotARun(f"the coordinator at {address} refused the token: {err.details()}")
    return RunControlError(f"the coordinator at {address} did not answer: {err.code().name} {err.details()}")


def last_record(run_dir: Path) -> dict | None:
    """The newest step record of metrics.jsonl (its last whole line)."""
    path = run_dir / "metrics.jsonl"
    try:
        with open_regular_file(path) as f:  # a FIFO in its place hung `status`
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except (OSError, UnreadableFile):
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            return record
    return None


def follow_log(path: Path, contact: Contact | None, out, poll_s: float = 0.5) -> None:
    """Print the log, then what is appended, until the run's coordinator is gone (or Ctrl-C)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across reads stays whole
    try:
        f = open_regular_file(path)  # a FIFO in a log's place is refused, not waited on
    except UnreadableFile as err:
        raise NotARun(f"{path}: {err}") from None
    with f:
        while True:
            chunk = f.read(LOG_READ_BYTES)  # a 3 GB log was read whole: a MemoryError
            if chunk:
                text = decoder.decode(chunk)
                out.write(plain(text, limit=len(text)))  # a worker's escape sequences shown, not obeyed
                out.flush()
            elif contact is None or not running(contact):
                return
            else:
                time.sleep(poll_s)
