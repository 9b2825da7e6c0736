"""A small disk to fill: a tmpfs mounted for a test (the tests run as root), for the full-disk cases."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(directory: Path, size: str):
    """A tmpfs of `size` mounted on `directory` for the block; skips only where mounting is not permitted."""
    libc = ctypes.CDLL(None, use_errno=True)
    directory.mkdir(parents=True, exist_ok=True)
    if libc.mount(b"tmpfs", str(directory).encode(), b"tmpfs", 0, f"size={size}".encode()) != 0:
        err = ctypes.get_errno()
        if err == errno.EPERM:
            pytest.skip("mount -t tmpfs refused with EPERM (not root, or no CAP_SYS_ADMIN in this container): "
                        "cannot make a small disk to fill")
        pytest.fail(f"mount -t tmpfs on {directory} failed: {os.strerror(err)}")
    try:
        yield directory
    finally:
        if libc.umount2(str(directory).encode(), 2) != 0:  # MNT_DETACH: even with a file still open
            pytest.fail(f"umount {directory} failed: {os.strerror(ctypes.get_errno())}")


def fill(directory: Path, leave_bytes: int) -> None:
    """Fill the file system of `directory` until about `leave_bytes` are left."""
    with open(directory / "filler", "wb") as f:
        free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        if free > leave_bytes:
            f.write(b"\0" * (free - leave_bytes))
