"""Shared helpers for tests that start real hetlaunch processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from finished_run import CLUSTER as FINISHED_RUN_CLUSTER

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


def session_processes(*words: str) -> list[psutil.Process]:
    """Live processes this test session started (its marker in their environment) whose command
    line has every word: a test running beside others (pytest -n) never picks another test's
    agent of the same node name."""
    found = []
    for proc in psutil.process_iter():
        try:
            cmd = proc.cmdline()
            if (all(w in cmd for w in words) and proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get(SESSION_MARKER) == os.environ[SESSION_MARKER]):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def agent_of(node: str) -> psutil.Process | None:
    """This session's agent process of `node`, if one is running."""
    agents = session_processes("hetlaunch.runtime.agent", f"--name={node}")
    return agents[0] if agents else None


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


def error_of(text: str) -> str:
    """The one-line ConfigError of cluster YAML text given as `cluster.yaml`."""
    from hetlaunch.launcher.config_types import ConfigError
    from hetlaunch.launcher.cluster_yaml import parse_cluster

    with pytest.raises(ConfigError) as info:
        parse_cluster(text, "cluster.yaml")
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("cluster.yaml: "), message
    return message


def hetlaunch_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def hetlaunch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetlaunch.launcher.cli", *args]


# SIGINT at its default in the CLIs the tests start, as from a terminal: a suite started in the
# background (`pytest &`) has it ignored, children inherit that, and Python then installs no
# KeyboardInterrupt, so the Ctrl-C tests failed there (2026-12-04) while passing from a terminal.
# Set here, in the suite's own process (a handler, unlike SIG_IGN, is not inherited across exec),
# never with Popen's preexec_fn: that makes Python fork instead of vfork, and in a test process
# that has used gRPC, gRPC's fork handler restarts its poller in the child, which then dies of
# SIGABRT ("epoll_wait: Bad file descriptor") when the child closes its inherited fds before exec
# (grpc/grpc#43055; seen once in tests/control under load, the CLI's returncode -6).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


def _gloo_rank(target, rank: int, world_size: int, port: int, out_dir: str, args: tuple = ()) -> None:
    """Child process: join a gloo group of `world_size` on the parent's store, run target(rank, out_dir, *args)."""
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            target(rank, out_dir, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out_dir, f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def run_gloo_ranks(target, world_size: int, out_dir: Path, timeout_s: float = 60, args: tuple = ()) -> None:
    """Run target(rank, out_dir, *args) in `world_size` fresh processes joined in one gloo group (real
    torch.distributed on 127.0.0.1); fail with every rank's traceback if any rank fails."""
    import datetime
    import multiprocessing

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: never fork the test process
    procs = [ctx.Process(target=_gloo_rank, args=(target, rank, world_size, store.port, str(out_dir), args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = {r: (out_dir / f"error{r}.txt").read_text() for r in range(world_size)
              if (out_dir / f"error{r}.txt").exists()}
    assert not errors, "\n".join(f"rank {r}:\n{text}" for r, text in errors.items())
    assert [p.exitcode for p in procs] == [0] * world_size
    del store


def final_parameters(run_dir: Path) -> dict:
    """The parameters (keyed `layers.<i>.<name>`) of a run's newest committed checkpoint."""
    from hetlaunch.runtime.checkpoint import load_layers
    from hetlaunch.runtime.checkpoint_manifest import latest_checkpoint

    found = latest_checkpoint(run_dir / "checkpoints")
    assert found is not None, f"no committed checkpoint under {run_dir / 'checkpoints'}"
    directory, manifest = found
    state = load_layers(directory, manifest, 0, manifest.num_layers)
    return {k: v for k, v in state.items() if k.startswith("layers.")}


def pytest_collection_modifyitems(config, items):
    """The quick tier (`-m quick`): tests/quick_tier.py lists it."""
    from quick_tier import mark_quick

    mark_quick(config, items)


# A finished run to spoil (tests/finished_run.py): made once per module that asks for it.
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    base = tmp_path_factory.mktemp("finished")
    (base / "cluster.yaml").write_text(FINISHED_RUN_CLUSTER.format(steps=4))
    result = run_hetlaunch("up", str(base / "cluster.yaml"), "--run-dir", str(base / "run"), timeout=150)
    assert result.returncode == 0, result.stderr
    return base / "run"


@pytest.fixture
def run_copy(finished, tmp_path):
    """A copy of the finished run, and its cluster YAML, for one case to spoil."""
    shutil.copytree(finished, tmp_path / "run", symlinks=True)
    (tmp_path / "cluster.yaml").write_text(FINISHED_RUN_CLUSTER.format(steps=4))
    return tmp_path / "run"
