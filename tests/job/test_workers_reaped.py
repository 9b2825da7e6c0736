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


@pytest.mark.timeout(60)
def test_closing_from_two_threads_at_once_reaps_the_spare_once_and_raises_nothing(tmp_path):
    """The lifeline's exit (Agent.exit) and the main thread leaving Agent.run can close the relay
    together: the spare is killed and waited for once, and neither caller raises (a raise in exit()
    had skipped its os._exit, leaving an agent without its job)."""
    import threading

    from hetlaunch.protos import worker_pb2 as wpb
    from hetlaunch.runtime.task_relay import TaskRelay

    relay = TaskRelay("n0", lambda method, request: None, None, wpb.StoreAccess(), None, [], tmp_path)
    relay.warm_up()  # a real worker process, as an agent starts one
    spare = relay.spare
    errors: list[BaseException] = []

    def close():
        try:
            relay.close()
        except BaseException as err:  # the test's own record of a raise
            errors.append(err)

    threads = [threading.Thread(target=close) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and relay.spare is None
    assert spare.process.returncode is not None, "the spare was not waited for"
    relay.close()  # a third call finds nothing to do


def test_a_spare_that_will_not_die_is_logged_not_raised(tmp_path, capsys):
    import subprocess as sp

    from hetlaunch.protos import worker_pb2 as wpb
    from hetlaunch.runtime.task_relay import TaskRelay

    class Stuck:
        """Stands in for a worker in uninterruptible sleep: SIGKILL does not end it."""
        pid = 4242

        def kill(self):
            pass

        def wait(self, timeout_s):
            raise sp.TimeoutExpired(["worker"], timeout_s)

    relay = TaskRelay("n0", lambda method, request: None, None, wpb.StoreAccess(), None, [], tmp_path)
    relay.spare = Stuck()
    relay.close()
    assert "spare worker 4242 did not exit" in capsys.readouterr().err
