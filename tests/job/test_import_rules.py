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
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["validate", "{yaml}"], ["validate", "{tls_yaml}"],
                                  ["plan", "--profile", "{profile}"]])
def test_commands_that_need_no_cluster_load_neither_torch_nor_grpc(tmp_path, args):
    from hetlaunch.launcher.certs import init_certs
    from hetlaunch.launcher.planning.profile_file import save_profile
    from plan_reference import uniform_profile

    save_profile(uniform_profile([1.0, 0.5], ["east", "west"]), tmp_path / "profile.json")
    (tmp_path / "cluster.yaml").write_text("nodes: [{name: a}]\n")
    init_certs(tmp_path / "certs", ["127.0.0.1"])  # validate reads each PEM file coordinator.tls names
    certs = tmp_path / "certs"
    (tmp_path / "tls.yaml").write_text(f"coordinator: {{tls: {{cert: {certs}/coordinator.pem, key: {certs}/coordinator.key, "
                                       f"ca: {certs}/ca.pem, agent_cert: {certs}/agent.pem, agent_key: {certs}/agent.key}}}}\n"
                                       "nodes: [{name: a}]\n")
    args = [a.format(yaml=tmp_path / "cluster.yaml", tls_yaml=tmp_path / "tls.yaml", profile=tmp_path / "profile.json")
            for a in args]
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


# --- The coordinator never loads torch ---------------------------------------------------------
# `hetlaunch up` is the coordinator: it plans, commits checkpoints and prices live moves, none of
# which needs a tensor; torch there would cost seconds and hundreds of MB on every start. A torch
# import that `up` reaches, directly or through runtime/, models/ or protos/, is caught here;
# tests/job/test_coordinator_torch_free.py checks the same on a real `up` process.

PACKAGE_DIRS = {"hetlaunch.launcher": "launcher", "hetlaunch.runtime": "runtime", "hetlaunch.protos": "protos",
                "hetlaunch.models": "models"}  # pyproject's package-dir
LOADS_TORCH = ("torch", "safetensors.torch", "transformers")
# Launcher functions that may load torch: they belong to commands that are not the coordinator
# (`validate` asks an entrypoint model its vocabulary; `up` calls model_vocabulary without asking).
MAY_LOAD_TORCH = {("launcher/cli.py", "agent"), ("launcher/export.py", "export"), ("launcher/export.py", "_check_shapes"),
                  ("launcher/export.py", "_write"),
                  ("launcher/token_check.py", "model_vocabulary")}


def source_of(module: str) -> Path | None:
    for package, folder in PACKAGE_DIRS.items():
        if module == package or module.startswith(package + "."):
            base = REPO / folder / module[len(package) + 1:].replace(".", "/")
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def executed_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, the top-level function it is inside or None) for every import that can run:
    `from a import b` also yields `a.b` (b may be a submodule); `if TYPE_CHECKING:` never runs."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(ast.Module(body=[other], type_ignores=[]), function)
                continue
            inside = function
            if function is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside = child.name
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, inside) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.append((child.lineno, child.module, inside))
                found.extend((child.lineno, f"{child.module}.{alias.name}", inside) for alias in child.names)
            visit(child, inside)

    visit(ast.parse(path.read_text(), filename=str(path)), None)
    return found


def torch_chains(start: Path, name: str | None = None) -> list[str]:
    """Each way that importing `start`, or calling a launcher function, reaches torch: every import
    of a launcher file (inside functions too), and what the modules it imports run when imported.
    Inside a runtime function is left to the real `up` of test_coordinator_torch_free.py
    (runtime/version.py's torch_version imports torch only where torch has no package metadata).
    `name`: where `start` stands in the repository, for a file written elsewhere."""
    names = {start: name or str(start.relative_to(REPO))}
    seen, todo, chains = {start}, [(start, names[start])], []
    while todo:
        path, chain = todo.pop()
        rel = names.get(path) or str(path.relative_to(REPO))
        for line, module, function in executed_imports(path):
            if (rel, function) in MAY_LOAD_TORCH or (function is not None and not rel.startswith("launcher/")):
                continue
            if any(module == t or module.startswith(t + ".") for t in LOADS_TORCH):
                chains.append(f"{chain}:{line} imports {module}")
                continue
            parts = module.split(".")
            for depth in range(2, len(parts) + 1):  # a module's packages run their __init__ first
                found = source_of(".".join(parts[:depth]))
                if found is not None and found not in seen:
                    seen.add(found)
                    todo.append((found, f"{chain}:{line} -> {found.relative_to(REPO)}"))
    return chains


def test_no_launcher_module_loads_torch_when_imported():
    problems = [c for f in sorted((REPO / "launcher").rglob("*.py")) for c in torch_chains(f)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line", ["import torch", "from safetensors.torch import save_file",
                                  "from hetlaunch.runtime.checkpoint import load_layers",
                                  "from hetlaunch.runtime import layer_transfer"])
def test_a_torch_import_of_the_launcher_is_caught_through_runtime_and_inside_functions(tmp_path, line):
    source = tmp_path / "added.py"
    source.write_text(f"def later():\n    {line}\n")
    assert torch_chains(source, "launcher/added.py"), f"{line!r} in launcher/ was not caught"


def test_a_command_that_is_not_the_coordinator_may_load_torch_inside_its_function(tmp_path):
    source = tmp_path / "export.py"
    source.write_text("def export():\n    import torch\n\ndef other():\n    import torch\n")
    assert torch_chains(source, "launcher/export.py") == ["launcher/export.py:5 imports torch"]


# --- No import cycles ----------------------------------------------------------------------------
# A cycle is a design knot (two modules that each need the other), usually hidden by moving one
# import into a function. Every import counts, top level or inside a function; `if TYPE_CHECKING:`
# never runs and does not.

def module_of(path: Path) -> str:
    """The import name of a source file (`launcher/planning/plan.py` -> hetlaunch.launcher.planning.plan)."""
    for package, folder in PACKAGE_DIRS.items():
        root = REPO / folder
        if path.is_relative_to(root):
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            return ".".join([package, *parts])
    raise ValueError(path)


def import_graph(files) -> dict[str, set[str]]:
    """module -> the package's modules it imports (inside functions too)."""
    graph = {}
    for path in files:
        me = module_of(path)
        found = {source_of(module) for _, module, _ in executed_imports(path)}
        graph[me] = {module_of(f) for f in found if f is not None} - {me}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first, iterative)."""
    done, on_path = set(), []
    for root in sorted(graph):
        if root in done:
            continue
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        on_path.append(root)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif child in on_path:
                return on_path[on_path.index(child):] + [child]
            elif child not in done:
                stack.append((child, iter(sorted(graph.get(child, ())))))
                on_path.append(child)
    return None


def package_files() -> list[Path]:
    return sorted(f for folder in PACKAGE_DIRS.values() for f in (REPO / folder).rglob("*.py"))


def test_no_import_cycles_among_the_package_modules():
    graph = import_graph(package_files())
    assert len(graph) > 100, sorted(graph)  # every package's modules were read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_and_printed_and_an_import_inside_a_function_is_an_edge(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c", "d"}, "c": set(), "d": {"b"}}) == ["b", "d", "b"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    # run_record imports session inside a function, as the cycle over JobError once did
    source = tmp_path / "run_record.py"
    source.write_text((REPO / "launcher" / "run_record.py").read_text()
                      + "\n\ndef later():\n    from hetlaunch.launcher.session import ClusterSession\n")
    graph = import_graph(package_files())
    graph["hetlaunch.launcher.run_record"] = {module_of(f) for _, m, _ in executed_imports(source)
                                              if (f := source_of(m)) is not None}
    cycle = find_cycle(graph)
    assert cycle is not None and {"hetlaunch.launcher.run_record", "hetlaunch.launcher.session"} <= set(cycle), cycle


TESTS = REPO / "tests"


def test_tests_live_in_folders_by_area_and_no_test_file_imports_another():
    """Shared helpers live in helper modules at tests/ (on the path through conftest.py); a test file
    importing another would run that file's tests' set-up twice and tie two areas together."""
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test files outside an area folder: {loose}"
    areas = sorted(p.parent.name for p in TESTS.glob("*/test_*.py"))
    assert len(set(areas)) >= 5, areas
    test_modules = {p.stem for p in TESTS.rglob("test_*.py")}
    crossing = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            crossing += [f"{path.relative_to(REPO)} imports {n}" for n in names if n.split(".")[-1] in test_modules]
    assert not crossing, crossing
