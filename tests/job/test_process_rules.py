"""No Python file here starts a process with Popen's preexec_fn.

preexec_fn makes Python fork (not vfork) and run Python in the child before exec. Every process
of hetlaunch, and the suite's own, may hold gRPC; gRPC's fork handler restarts its poller in the
child, and the child's closing of its inherited fds (close_fds) then kills it with SIGABRT
("epoll_wait: Bad file descriptor", grpc/grpc#43055) before exec. That cost a test run once:
tests/conftest.py had reset SIGINT in a preexec_fn (it now does so in its own process)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO


def preexec_calls(path: Path) -> list[str]:
    """'file:line' for each call in the file that passes preexec_fn."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}"
            for node in ast.walk(tree) if isinstance(node, ast.Call)
            and any(k.arg == "preexec_fn" for k in node.keywords)]


def test_no_process_is_started_with_a_preexec_fn():
    # Not a virtual environment inside the checkout (`python -m venv venv` there holds torch's files)
    files = [p for p in REPO.rglob("*.py") if not any(part.startswith(".") or part in ("build", "__pycache__",
                                                                                       "site-packages")
                                                     for part in p.relative_to(REPO).parts)]
    assert len(files) > 100, "the walk found the repository's files"
    assert [hit for f in files for hit in preexec_calls(f)] == []


def test_a_preexec_fn_is_found(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import subprocess\n\nsubprocess.Popen(['true'],\n    preexec_fn=lambda: None)\n")
    assert preexec_calls(sample) == [f"{sample}:3"]
