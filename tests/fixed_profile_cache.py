"""A profile cache whose layer timings a test sets, so that `hetlaunch up` plans the same way
however loaded this machine is (tests/job/test_device_pipelines_up.py and others): the cluster's
nodes are measured once by `hetlaunch profile` into a cache of the test's own, which must hold one
entry (nodes alike), and that entry's layer timings are replaced by `layer_s` each, the optimizer's
by 1e-4 s, the backward left unsplit (halved by the planner). Links are still probed live."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import hetlaunch_env, run_hetlaunch


def fixed_timings_env(root: Path, cluster_yaml: str, num_layers: int, layer_s: float = 0.1) -> dict[str, str]:
    """The environment (HETLAUNCH_CACHE_DIR set) of a cache holding `cluster_yaml`'s nodes' one
    entry, every layer `layer_s`."""
    env = hetlaunch_env(HETLAUNCH_CACHE_DIR=str(root / "cache"))
    path = root / "profile.yaml"
    path.write_text(cluster_yaml)
    measured = run_hetlaunch("profile", str(path), "-o", str(root / "profile.json"), timeout=240, env=env, cwd=root)
    assert measured.returncode == 0, measured.stderr + measured.stdout
    (entry,) = (root / "cache" / "profiles").glob("*.json")  # one cache key: the nodes are alike
    timings = json.loads(entry.read_text())
    assert len(timings["layer_seconds"]) == num_layers
    timings.update(layer_seconds=[layer_s] * num_layers, optimizer_seconds=[1e-4] * num_layers)
    timings.pop("input_grad_seconds", None)
    timings.pop("weight_grad_seconds", None)
    entry.write_text(json.dumps(timings))
    return env
