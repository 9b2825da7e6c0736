"""Length-framed protobuf messages over a pipe between an agent and its worker.

A frame is a 4-byte big-endian length and then that many bytes of one message. Both ends
are processes of one host that one agent started, but a worker runs user code (an
entrypoint model), so the reader still bounds what it accepts and parses nothing but
protobuf.
"""

from __future__ import annotations

import os
import struct
import threading

MAX_FRAME_BYTES = 64 * 2**20  # a RunStage or a profile report is kilobytes; this is a sanity bound
_HEADER = struct.Struct(">I")


class PipeClosed(EOFError):
    """The other end closed the pipe (exited or was killed)."""


class FrameError(ValueError):
    """A frame that cannot be a message of ours."""


class FrameWriter:
    """Writes whole frames to a file descriptor; several threads may write."""

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()

    def write(self, message) -> None:
        data = message.SerializeToString()
        if len(data) > MAX_FRAME_BYTES:
            raise FrameError(f"a {type(message).__name__} of {len(data):,} bytes exceeds {MAX_FRAME_BYTES:,}")
        frame = memoryview(_HEADER.pack(len(data)) + data)
        with self._lock:
            if self.fd < 0:
                raise PipeClosed("this writer was closed")
            while frame:
                try:
                    written = os.write(self.fd, frame)
                except BrokenPipeError:
                    raise PipeClosed("the reader is gone") from None
                frame = frame[written:]

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def detach(self) -> None:
        """Never write again, without closing: the descriptor belongs to someone else (a file
        object) who closes it. Its number is then reused by the next pipe opened, so a late
        write through this writer would land there: in another worker's control pipe."""
        with self._lock:
            self.fd = -1


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise PipeClosed("the writer is gone")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, message_type):
    """The next message from `fd`; PipeClosed at end of file, FrameError on a bad frame."""
    (length,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    if length > MAX_FRAME_BYTES:
        raise FrameError(f"a frame of {length:,} bytes exceeds {MAX_FRAME_BYTES:,}")
    message = message_type()
    try:
        message.ParseFromString(_read_exact(fd, length))
    except PipeClosed:
        raise
    except Exception as err:  # protobuf's DecodeError; anything else it may raise on garbage
        raise FrameError(f"not a {message_type.__name__}: {err}") from None
    return message
