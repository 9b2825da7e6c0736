"""Every packet on one interface while it runs (AF_PACKET, root): does any hold a byte pattern?

In-process as a context manager (`PacketCapture("lo", pattern)`), or as a program inside a
network namespace (`ip netns exec NS python wire_capture.py IFACE HEX_PATTERN OUT.json`): it
writes OUT.json.ready once listening, and OUT.json ({"packets": n, "found": bool}) when it gets
SIGTERM. Only reads: nothing is sent.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
from pathlib import Path

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux's value; Python does not name it
ETH_P_ALL = 0x0003


class PacketCapture:
    def __init__(self, interface: str, pattern: bytes):
        self.pattern, self.found, self.packets = pattern, False, 0
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
        # Forced past net.core.rmem_max (as root): a reader slowed by a busy machine drops nothing.
        self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 * 2**20)
        self._sock.bind((interface, 0))
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                packet = self._sock.recv(1 << 17)
            except socket.timeout:
                continue
            self.packets += 1
            self.found |= self.pattern in packet

    def __enter__(self) -> "PacketCapture":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def main(interface: str, pattern_hex: str, out: str) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with PacketCapture(interface, bytes.fromhex(pattern_hex)) as capture:
        Path(out + ".ready").write_text("listening\n")
        stop.wait(600)  # the test stops it long before
    Path(out).write_text(json.dumps({"packets": capture.packets, "found": capture.found}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
