"""An agent supervises; its workers compute. The agent process never loads torch where no GPU
driver is present (runtime/node_devices.py): a CPU host's agent costs no torch import (about 2 s of
CPU and 200 MB each), which every agent start paid for describing a CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import yaml

from conftest import REPO, hetlaunch_env, popen_hetlaunch, stop_process, wait_for


def _loads_torch(pid: int) -> bool:
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_importing_the_agent_and_describing_a_cpu_host_loads_no_torch():
    code = ("import sys\n"
            "import hetlaunch.runtime.agent\n"
            "from hetlaunch.runtime.node_devices import describe_devices, gpu_driver_present\n"
            "devices = describe_devices()\n"
            "print(gpu_driver_present(), devices[0].kind, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=hetlaunch_env())
    assert out.returncode == 0, out.stderr
    driver, kind, loaded = out.stdout.split()
    if driver == "False":  # this host: a CPU is announced without torch
        assert (kind, loaded) == ("1", "False"), out.stdout  # 1: DEVICE_KIND_CPU
    else:  # a GPU host asks torch, as it must
        assert loaded == "True", out.stdout


def test_the_agents_of_a_running_job_hold_no_torch_while_their_workers_train(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    cluster["train"]["steps"] = 400
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(run_dir))
    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().count("\n") >= 3,
                 120, "3 steps", proc=up)
        children = psutil.Process(up.pid).children(recursive=True)
        agents = [p.pid for p in children if "hetlaunch.runtime.agent" in " ".join(p.cmdline())]
        workers = [p.pid for p in children if "hetlaunch.runtime.worker" in " ".join(p.cmdline())]
        assert len(agents) == 3 and len(workers) >= 3, (agents, workers)
        assert all(_loads_torch(pid) for pid in workers)  # the check sees torch where it is loaded
        assert not any(_loads_torch(pid) for pid in agents)
    finally:
        stop_process(up)
