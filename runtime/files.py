"""Files written whole or not at all (a reader, or a crash, never sees half of one), and JSON
files read without trusting them."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Iterator


def write_whole(path: Path, text: str | bytes, mode: int = 0o666) -> None:
    """Replace `path` with `text` whole or not at all: a temporary file beside it, fsynced, renamed
    over it, the directory fsynced. Raises OSError; the temporary file never stays behind.
    `mode` applies from creation on (0o600: never readable by others, not even briefly)."""
    data = text.encode() if isinstance(text, str) else text
    tmp = _temp_name(path)
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


def new_temp_beside(path: Path) -> Path:
    """A new empty file beside `path` with a name of its own, created as a plain file is (mode
    0o666 less the umask; mkstemp's 0o600 made exports unreadable to the user's group), for a
    writer that takes a path; the caller renames it over `path` or removes it."""
    tmp = _temp_name(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
    return tmp


@contextlib.contextmanager
def whole_file_beside(path: Path) -> Iterator[BinaryIO]:
    """A file open for writing that becomes `path` whole when the block ends (fsynced, renamed over
    it) and leaves nothing when the block raises. Where Linux allows (O_TMPFILE and /proc), the
    file has no name until it is whole, so a SIGKILL or the OOM killer mid-way leaves nothing
    behind either (a named temp file left gigabytes of a large corpus); elsewhere a hidden temp
    name beside `path`. Created as a plain file is (0o666 less the umask). An OSError names `path`."""
    fd, tmp = _unnamed_beside(path), None
    if fd is None:
        tmp = _temp_name(path)
        fd = _named(path, lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            yield out
            out.flush()
        os.fsync(fd)
        if tmp is None:  # named only now, whole, and at once renamed over `path`
            tmp = _temp_name(path)
            _named(path, lambda: _link_unnamed(fd, tmp))
        _named(path, lambda: os.replace(tmp, path))
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    _fsync_dir(path.parent)


def _unnamed_beside(path: Path) -> int | None:
    """An O_TMPFILE descriptor in path's folder that /proc can name later, or None where either is
    missing (another OS, a file system without it, no /proc)."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    try:
        fd = os.open(path.parent, flag | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise OSError(err.errno, err.strerror, str(path)) from None
    if not os.path.exists(f"/proc/self/fd/{fd}"):
        os.close(fd)
        return None
    return fd


def _link_unnamed(fd: int, name: Path) -> None:
    """Give the O_TMPFILE file `fd` the name `name`: linkat(2) of its /proc link, followed. A
    directory descriptor makes os.link call linkat with AT_SYMLINK_FOLLOW; without one it calls
    link(2), which links the /proc entry itself and fails with EXDEV."""
    # O_PATH: a folder one may write but not list (mode 0333) refused O_RDONLY, after all the writing.
    folder = os.open(name.parent, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", name.name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=True)
    finally:
        os.close(folder)


def _named(path: Path, call):
    """call(), its OSError naming `path` rather than a hidden temp name the user never gave."""
    try:
        return call()
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None


def _temp_name(path: Path) -> Path:
    """A hidden name beside `path`, its own (created with O_EXCL: never another's file or link)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


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


class UnreadableFile(ValueError):
    """One-line reason a file another program (or host, or a past crash) left is not usable."""


def open_regular_file(path: str | Path, follow_link: bool = True):
    """The file open for binary reading, never blocking on it: a FIFO or a device (/dev/zero) in
    its place is UnreadableFile("not a regular file"), not waited on or read without end. With
    follow_link False, a symbolic link in its place is UnreadableFile too, not followed (a folder
    handed over could point a name at any file of the reader's). FileNotFoundError passes
    through; any other failure is UnreadableFile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_link else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_link:
            raise UnreadableFile("a link, not a file of its own (not followed)") from None
        raise UnreadableFile(f"cannot read ({err.strerror or err})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnreadableFile("not a regular file")
    return os.fdopen(fd, "rb")


def read_regular_file(path: str | Path, max_bytes: int, follow_link: bool = True) -> bytes:
    """A small file's bytes, read as if it may be hostile: open_regular_file, and never more than
    max_bytes. FileNotFoundError passes through; any other failure is UnreadableFile."""
    try:
        with open_regular_file(path, follow_link) as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise UnreadableFile(f"cannot read ({err.strerror or err})") from None
    if len(raw) > max_bytes:
        raise UnreadableFile(f"larger than {max_bytes:,} bytes")
    return raw


def read_json(path: Path, max_bytes: int, follow_link: bool = True) -> object:
    """Parse a JSON file that may be hostile: read by read_regular_file, and everything Python's
    json would raise on (NaN and Infinity, an integer of thousands of digits, deep nesting, bytes
    that are not UTF-8), and a key given twice in one object, turned into UnreadableFile.
    FileNotFoundError passes through."""
    raw = read_regular_file(path, max_bytes, follow_link)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"not UTF-8 text (byte {err.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise UnreadableFile(f"not valid JSON (line {err.lineno}): {err.msg}") from None
    except UnreadableFile:
        raise
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise UnreadableFile("a number with too many digits") from None
    except RecursionError:
        raise UnreadableFile("nested too deeply") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object whose keys are all different: Python's json kept the last of two equal keys, so a
    file read one way here could mean another to the tool or person that wrote it."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise UnreadableFile(f"key {twice[:40]!r} appears twice in one object")
    return out


def _no_constant(name: str):
    raise UnreadableFile(f"{name} is not a JSON number")
