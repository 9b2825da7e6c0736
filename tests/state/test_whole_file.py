"""runtime/files.py whole_file_beside: a file becomes its path whole or not at all, and while it is
written it has no name (O_TMPFILE), so a process killed mid-way (SIGKILL, the OOM killer) leaves
nothing behind; where the OS has no unnamed files, a hidden temp name removed on failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hetlaunch.runtime import files
from hetlaunch.runtime.files import whole_file_beside

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("unnamed", [True, False])
def test_the_file_replaces_its_path_whole_with_a_plain_files_mode(tmp_path, monkeypatch, unnamed):
    if not unnamed:
        monkeypatch.setattr(files, "_unnamed_beside", lambda path: None)
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with whole_file_beside(target) as out:
        out.write(b"new " * 1000)
        assert target.read_bytes() == b"old"  # untouched until the block ends
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["out.bin"]
        assert bool(list(tmp_path.glob(".out.bin.*.tmp"))) is not unnamed  # a name only where unnamed is missing
    assert target.read_bytes() == b"new " * 1000
    assert os.listdir(tmp_path) == ["out.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("unnamed", [True, False])
def test_a_failure_in_the_block_leaves_the_old_file_and_nothing_else(tmp_path, monkeypatch, unnamed):
    if not unnamed:
        monkeypatch.setattr(files, "_unnamed_beside", lambda path: None)
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with whole_file_beside(target) as out:
            out.write(b"half")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["out.bin"] and target.read_bytes() == b"old"


@pytest.mark.parametrize("unnamed", [True, False])
def test_an_error_names_the_path_asked_for_not_a_temp_name(tmp_path, monkeypatch, unnamed):
    if not unnamed:
        monkeypatch.setattr(files, "_unnamed_beside", lambda path: None)
    with pytest.raises(FileNotFoundError) as caught:
        with whole_file_beside(tmp_path / "missing" / "out.bin"):
            pass
    assert caught.value.filename == str(tmp_path / "missing" / "out.bin")


def test_a_process_killed_while_writing_leaves_nothing_behind(tmp_path):
    # Where the OS lacks unnamed files, a SIGKILL leaves the hidden temp name: this test is about
    # the Linux path, which CI runs on.
    probe = files._unnamed_beside(tmp_path / "probe")
    assert probe is not None, "O_TMPFILE with /proc is expected on Linux"
    os.close(probe)
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from hetlaunch.runtime.files import whole_file_beside
        with whole_file_beside(Path({str(tmp_path / 'out.bin')!r})) as out:
            out.write(b"x" * 1_000_000)
            out.flush()
            print("writing", flush=True)
            time.sleep(120)
        """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert os.listdir(tmp_path) == []  # written, and no name in the folder
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert os.listdir(tmp_path) == []


def test_a_folder_one_may_write_but_not_list_takes_the_file():
    """The unnamed file is linked through a descriptor of its folder, which O_RDONLY could not open
    in a folder of mode 0333: the write failed after all the work (a review). Run as an unprivileged
    user, for whom the mode counts (root's permissions ignore it)."""
    import shutil
    import tempfile

    # Not under pytest's tmp_path: its root folder is root's alone, where the other user cannot go.
    top = Path(tempfile.mkdtemp(prefix="hetlaunch-drop-", dir="/tmp"))
    folder = top / "drop"
    folder.mkdir()
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from hetlaunch.runtime.files import whole_file_beside  # before the user changes: root's files
        if os.getuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        with whole_file_beside(Path({str(folder / 'out.bin')!r})) as out:
            out.write(b"data")
        """)
    try:
        if os.getuid() == 0:
            os.chown(folder, 65534, 65534)
        top.chmod(0o755)
        folder.chmod(0o333)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        folder.chmod(0o755)
        assert (folder / "out.bin").read_bytes() == b"data"
    finally:
        folder.chmod(0o755)
        shutil.rmtree(top)
