"""The dependency rules of the design brief, checked on every import statement (top level and
inside functions) of the package's source:

- runtime never imports launcher: an agent installs and runs without the planner;
- launcher/planning imports only itself, runtime/registry.py, runtime/files.py and runtime/schedules.py (the
  schedules as data, which the planner prices by simulation): no grpc, no protos, no torch,
  no live session, so a plan can be made offline from a profile;
- protos imports neither launcher nor runtime.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, relative imports resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; write hetlaunch.… in full")
            found.append((node.lineno, node.module or ""))
    return found


def forbidden_imports(path: Path, allowed, forbidden) -> list[str]:
    out = []
    for line, module in imported_modules(path):
        if any(module == f or module.startswith(f + ".") for f in forbidden) and not allowed(module):
            out.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}: imports {module}")
    return out


def check_runtime(path: Path) -> list[str]:
    return forbidden_imports(path, lambda m: False, ["hetlaunch.launcher"])


PLANNING_ALLOWED = ("hetlaunch.launcher.planning", "hetlaunch.runtime.registry", "hetlaunch.runtime.files",
                    "hetlaunch.runtime.schedules")


def check_planning(path: Path) -> list[str]:
    return forbidden_imports(path, lambda m: m.startswith(PLANNING_ALLOWED),
                             ["hetlaunch", "grpc", "grpc_health", "google.protobuf", "torch"])


def check_protos(path: Path) -> list[str]:
    return forbidden_imports(path, lambda m: False, ["hetlaunch.launcher", "hetlaunch.runtime"])


RULES = [("runtime", check_runtime), ("launcher/planning", check_planning), ("protos", check_protos)]


@pytest.mark.parametrize("folder,check", RULES, ids=[folder for folder, _ in RULES])
def test_import_rules_hold(folder, check):
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, folder
    problems = [p for f in files for p in check(f)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("folder,check,line", [
    ("runtime", check_runtime, "from hetlaunch.launcher.session import ClusterSession"),
    ("launcher/planning", check_planning, "import grpc"),
    ("launcher/planning", check_planning, "from hetlaunch.protos import control_pb2"),
    ("launcher/planning", check_planning, "from hetlaunch.launcher.session import JobError"),
    ("launcher/planning", check_planning, "from hetlaunch.runtime.codecs import CODECS"),
    ("launcher/planning", check_planning, "import torch.nn"),
    ("protos", check_protos, "from hetlaunch.runtime import wire"),
])
def test_a_forbidden_import_is_caught_even_inside_a_function(tmp_path, folder, check, line):
    source = tmp_path / "added.py"
    source.write_text(f"def later():\n    {line}\n")
    assert check(source), f"{line!r} in {folder} was not caught"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["validate", "{yaml}"], ["plan", "--profile", "{profile}"]])
def test_commands_that_need_no_cluster_load_neither_torch_nor_grpc(tmp_path, args):
    from hetlaunch.launcher.planning.profile_file import save_profile
    from test_planner import uniform_profile

    save_profile(uniform_profile([1.0, 0.5], ["east", "west"]), tmp_path / "profile.json")
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: a}]\n")
    args = [a.format(yaml=tmp_path / "cluster.yaml", profile=tmp_path / "profile.json") for a in args]
    code = ("import sys\n"
            "from hetlaunch.launcher import cli\n"
            "try:\n"
            f"    cli.app({args!r})\n"
            "except SystemExit as exit:\n"
            "    assert exit.code in (0, None), exit.code\n"
            "print(sorted(m for m in ('torch', 'grpc', 'hetlaunch.protos') if m in sys.modules), file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr
