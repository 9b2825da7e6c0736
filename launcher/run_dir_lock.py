"""One coordinator per run directory.

Two `hetlaunch up` on one `--run-dir` (or a `--resume` of a run still going) would both write
coordinator.json, the token, metrics.jsonl and the checkpoints: the first job's lines lost and
its checkpoints mixed with the other's. `up` holds an exclusive lock on `<run dir>/up.lock` for
as long as it runs; another refuses in one line naming the holder. The lock is the kernel's
(flock): it ends with the process however that ends — a crash or SIGKILL leaves no stale lock
for `--resume` to trip on. The run's checkpoint directory is locked alike (CheckpointDirLock).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from hetlaunch.launcher.job_errors import JobError

LOCK_NAME = "up.lock"


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    def _in_use(self, holder: str) -> str:
        return (f"{self.path.parent} is in use by another hetlaunch up{holder}: wait for it to end "
                f"(or `hetlaunch down {self.path.parent}`), or use another --run-dir")

    def _cannot_lock(self, err: OSError) -> None:
        raise JobError(f"cannot lock the run directory ({self.path}): {err.strerror or err}") from None

    def __enter__(self) -> "RunDirLock":
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            self._cannot_lock(err)
            return self
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise JobError(self._in_use(holder)) from None
        except OSError as err:
            os.close(fd)
            self._cannot_lock(err)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race a new holder)
            self._fd = None


class CheckpointDirLock(RunDirLock):
    """The same for the run's checkpoint directory (the default one inside the run directory
    too, so a `checkpoint.dir` naming it is refused while the run goes on): two runs sharing one
    pruned, overwrote and deleted each other's checkpoints (a hostile review: the second run's
    step 10 replaced the first's, the first's prune removed the second's part). Where the file
    system has no locks (some network ones), the run goes on unlocked, as before. A directory
    made for the lock that nothing else was written into is removed again at the end."""

    def __init__(self, directory: Path):
        self.made = False
        try:
            self.made = not directory.exists()
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # then it cannot be locked either; writing a checkpoint there says why
        super().__init__(directory)

    def _in_use(self, holder: str) -> str:
        return (f"checkpoint.dir {self.path.parent} is in use by another hetlaunch up{holder}: give this run a "
                "checkpoint directory of its own")

    def _cannot_lock(self, err: OSError) -> None:
        pass

    def __exit__(self, *exc) -> None:
        # Tidied while the lock is held: after it, the file may be another run's lock already.
        if self.made and self._fd is not None:
            try:
                if [p.name for p in self.path.parent.iterdir()] == [LOCK_NAME]:
                    self.path.unlink()
                    self.path.parent.rmdir()
            except OSError:
                pass
        super().__exit__(*exc)


def _holder(fd: int) -> str:
    """' (pid N)' as the holder wrote it, or '' if it cannot be read."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {text})" if text.isdigit() else ""
