"""`hetlaunch up` is the coordinator, and the coordinator never loads torch: only the agents'
stage processes hold tensors. Checked on the modules (every launcher module imported in a fresh
interpreter) and on a real `up` run in one process that watches every import it makes (an audit
hook, so the first import of torch is reported with the stack that made it).
tests/job/test_import_rules.py checks the same statically, import by import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, hetlaunch_env

# Watches the process from its first line: `up` runs in it (as `hetlaunch up` would), not in a child.
_WATCHED_UP = """
import json, sys, traceback

first = []


def watch(event, args):
    if event == "import" and args[0] == "torch" and not first:
        first.append("".join(traceback.format_stack()))


sys.addaudithook(watch)
import hetlaunch.launcher.cli as cli  # this spelling marks the process as ours for the stray check

code = 0
try:
    cli.app(sys.argv[2:])
except SystemExit as exit:
    code = exit.code
with open(sys.argv[1], "w") as f:
    json.dump({"exit": code, "torch": "torch" in sys.modules, "first_import": first[:1]}, f)
"""


def _launcher_modules() -> list[str]:
    return sorted("hetlaunch." + ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                  for p in (REPO / "launcher").rglob("*.py"))


@pytest.mark.timeout(90)
def test_importing_every_launcher_module_loads_no_torch():
    modules = _launcher_modules()
    assert "hetlaunch.launcher.job_driver" in modules and "hetlaunch.launcher.checkpoint_book" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    if 'torch' in sys.modules:\n"
            "        sys.exit(f'importing {name} loaded torch')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=80,
                            env=hetlaunch_env())
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(240)
def test_a_whole_up_run_never_loads_torch_in_the_coordinator(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    # Checkpoints committed and pruned by the coordinator, and TensorBoard scalars written by it: the
    # paths that used to load torch there (runtime/checkpoint.py, torch.utils.tensorboard).
    cluster["train"].update(steps=6, checkpoint_every=2)
    cluster["checkpoint"] = {"keep": 1}
    cluster["observe"] = {"tensorboard": True}
    path, run_dir, report = tmp_path / "c.yaml", tmp_path / "run", tmp_path / "watched.json"
    path.write_text(yaml.safe_dump(cluster))
    result = subprocess.run([sys.executable, "-c", _WATCHED_UP, str(report), "up", str(path), "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=200, env=hetlaunch_env(), cwd=tmp_path)
    assert report.exists(), result.stderr + result.stdout
    watched = json.loads(report.read_text())
    assert watched["exit"] in (0, None), result.stderr + result.stdout
    assert not watched["torch"], "the coordinator imported torch, first here:\n" + "".join(watched["first_import"])
    # It did what this test relies on: trained every step, committed checkpoints, wrote scalars.
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 6
    assert [d.name for d in (run_dir / "checkpoints").iterdir() if (d / "manifest.json").exists()] == ["step-00000006"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
