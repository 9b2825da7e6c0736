"""Files written whole or not at all: a reader (or a crash) never sees half of one."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path


def write_whole(path: Path, text: str | bytes, mode: int = 0o666) -> None:
    """Replace `path` with `text` whole or not at all: a temporary file beside it, fsynced, renamed
    over it, the directory fsynced. Raises OSError; the temporary file never stays behind.
    `mode` applies from creation on (0o600: never readable by others, not even briefly)."""
    data = text.encode() if isinstance(text, str) else text
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if written == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename itself is done
    finally:
        os.close(fd)
