"""Shared helpers for tests that start real hetlaunch processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


def _is_ours(proc: psutil.Process) -> bool:
    try:
        cmd = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "hetlaunch.runtime.agent" in cmd or "hetlaunch agent" in cmd or "hetlaunch up" in cmd


def stray_processes() -> list[psutil.Process]:
    me = os.getpid()
    return [p for p in psutil.process_iter() if p.pid != me and _is_ours(p) and p.status() != psutil.STATUS_ZOMBIE]


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
    assert not strays, f"processes left behind: {[' '.join(p.cmdline()) for p in strays]}"


def hetlaunch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def hetlaunch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetlaunch.launcher.cli", *args]


def run_hetlaunch(*args: str, timeout: float = 180, env: dict | None = None,
                  cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(hetlaunch_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=env or hetlaunch_env(), cwd=cwd)
