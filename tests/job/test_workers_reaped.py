"""When `hetlaunch up` ends, every process it started has been waited for by its own parent.

The worker that ran an agent's last task stays as the spare; the agent used to exit without
reaping it, so it ran on as an orphan until its pipe closed, after `up` had returned, and its
CPU time never reached whoever waited for `up` (the benches' busy-machine check counted a
whole run's training as other work). Here `up` runs under a child subreaper: an orphan of any
depth is handed to it, so after `up` returns the subreaper must have no child left to wait for.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, hetlaunch_cmd, hetlaunch_env

SUBREAPER = r"""
import ctypes, json, os, subprocess, sys
PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
up = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True, timeout=150)
left = []
for entry in os.listdir("/proc"):  # what was handed to us, named while it still runs
    if entry.isdigit():
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    left.append(f.read().replace(b"\0", b" ").decode(errors="replace").strip() or "(exited)")
        except (OSError, ValueError, IndexError):
            pass
reaped = 0
while True:  # blocks until each orphan has exited; ends at once when there is none
    try:
        os.waitpid(-1, 0)
        reaped += 1
    except ChildProcessError:
        break
print(json.dumps({"rc": up.returncode, "stderr": up.stderr[-2000:], "orphans": left, "reaped": reaped}))
"""


@pytest.mark.timeout(180)
def test_up_leaves_no_process_for_anyone_else_to_reap(tmp_path):
    cluster = yaml.safe_load((REPO / "cluster_examples" / "tiny_test.yaml").read_text())
    cluster["train"].update(steps=2, checkpoint_every=0)
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    command = hetlaunch_cmd("up", str(tmp_path / "cluster.yaml"), "--run-dir", str(tmp_path / "run"))
    done = subprocess.run([sys.executable, "-c", SUBREAPER, json.dumps(command)], capture_output=True, text=True,
                          timeout=170, env=hetlaunch_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, report["stderr"]
    assert report["reaped"] == 0, f"left for the subreaper to wait for: {report['orphans']} ({report['reaped']} in all)"
