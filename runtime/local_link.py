"""The boundary between two stages on one device: a V-shaped schedule's two middle stages sit on
the last device, and its activation goes from one to the other without a wire.

It is a link (runtime/link.py) in what the executor sees: `send`, `recv`, `drain`, `stats`. A
message is copied on send (`clone`), as a wire would copy it, so the receiving stage can never
change a tensor the sending stage keeps for its backward. The device runs its actions one after
another, so a receive must find its message already sent: the schedule's simulation proves the
order does (runtime/simulation.py); a receive on an empty queue is a schedule bug and says so.
"""

from __future__ import annotations

from collections import deque

from hetlaunch.runtime.boundary import Message, map_tensors
from hetlaunch.runtime.link import LinkStats


class LocalLink:
    """One end of an in-device boundary; `local_boundary` makes the two ends."""

    least_transit = None  # nothing crosses a wire: no transit to report
    sealing = None

    def __init__(self, outgoing: deque, incoming: deque, what: str):
        self._outgoing, self._incoming, self._what = outgoing, incoming, what
        self.stats = LinkStats()

    def send(self, message: Message) -> None:
        self.stats.messages += 1
        self._outgoing.append(map_tensors(lambda t: t.detach().clone(), message))

    def recv(self) -> Message:
        if not self._incoming:
            raise RuntimeError(f"the schedule receives on {self._what} before anything was sent on it "
                               f"(both stages are on this device, which runs one action at a time)")
        return self._incoming.popleft()

    def expect(self, count: int = 1) -> None:
        """Nothing to receive ahead: the message is already in memory when it is sent."""

    def stop_receiving(self) -> bool:
        return False

    def ready(self) -> bool:
        return bool(self._incoming)

    def drain(self) -> float:
        return 0.0

    def retarget(self, *_args) -> None:
        """Nothing is encoded inside a device."""


def local_boundary(upstream_stage: int) -> tuple[LocalLink, LocalLink]:
    """(the upstream stage's next link, the downstream stage's previous link) of the boundary
    after stage `upstream_stage`."""
    down: deque = deque()
    up: deque = deque()
    what = f"the boundary between stages {upstream_stage} and {upstream_stage + 1}"
    return LocalLink(down, up, what), LocalLink(up, down, what)

