"""Shared helpers for tests that start real hetlaunch processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


# Every process this test session starts inherits this marker (hetlaunch_env copies os.environ, and `up`
# passes its environment on to its agents), so the stray check never touches hetlaunch processes that
# someone else runs on the same machine at the same time.
SESSION_MARKER = "HETLAUNCH_TEST_SESSION"
os.environ[SESSION_MARKER] = str(os.getpid())


def _is_ours(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
        if not ("hetlaunch.runtime.agent" in cmd or "hetlaunch.launcher.cli" in cmd
                or "hetlaunch agent" in cmd or "hetlaunch up" in cmd):
            return False
        return proc.environ().get(SESSION_MARKER) == os.environ[SESSION_MARKER] and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def stray_processes() -> list[psutil.Process]:
    """Live hetlaunch processes started by this test session (not by anyone else on the machine)."""
    me = os.getpid()
    return [p for p in psutil.process_iter() if p.pid != me and _is_ours(p)]


@pytest.fixture(autouse=True)
def no_stray_processes():
    """Every test must leave no hetlaunch process behind; strays are killed and the test fails."""
    yield
    deadline = time.monotonic() + 15
    strays = stray_processes()
    while strays and time.monotonic() < deadline:
        time.sleep(0.2)
        strays = stray_processes()
    for p in strays:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not strays, f"processes left behind: {[_describe(p) for p in strays]}"


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}: {' '.join(proc.cmdline())}"
    except psutil.Error:
        return str(proc.pid)


def hetlaunch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def hetlaunch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetlaunch.launcher.cli", *args]


def popen_hetlaunch(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """Start the CLI in the background, output to temporary files (a full pipe never blocks it).

    Pair with `stop_process` in a `finally`; `output(proc)` reads what it wrote so far."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(hetlaunch_cmd(*args), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            text=True, env=env or hetlaunch_env(), cwd=cwd)
    proc.out_file, proc.err_file = out, err
    return proc


def output(proc: subprocess.Popen) -> tuple[str, str]:
    """(stdout, stderr) of a process started by `popen_hetlaunch`, so far."""
    texts = []
    for f in (proc.out_file, proc.err_file):
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> tuple[str, str]:
    """Make sure `proc` is gone (SIGTERM, then SIGKILL); return (stdout, stderr)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    return output(proc)


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, interval: float = 0.1):
    """Poll until predicate() is truthy; fail naming `what` (and why, if `proc` died meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            out, err = output(proc) if hasattr(proc, "err_file") else ("", "")
            pytest.fail(f"process exited with {proc.returncode} while waiting for {what}:\n{err}\n{out}")
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}")


def run_hetlaunch(*args: str, timeout: float = 180, env: dict | None = None,
                  cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(hetlaunch_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=env or hetlaunch_env(), cwd=cwd)
