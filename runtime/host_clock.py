"""Seconds since the epoch that a step of this host's clock cannot move: for stamps that cross hosts.

A message's transit is its receiver's clock minus its sender's, corrected by the two hosts'
offsets to the coordinator's clock (runtime/clock_offset.py). With the system's wall clock, an
NTP step of +0.5 s on one host read as half a second more on every message: "link a -> r carries
1.0 Mbit/s (profiled 152.4)", and a restart onto a plan without the node. So every such stamp is
this host's wall clock as it was when the agent started, advanced by the monotonic clock, which
no step moves (and which all processes of a host share): the agent passes its anchor to its
workers, so their stamps and its heartbeats' clock offset agree. The coordinator uses its own.
"""

from __future__ import annotations

import time

_anchor = time.time() - time.monotonic()


def now() -> float:
    """This host's wall clock as of the anchor, advanced by its monotonic clock."""
    return _anchor + time.monotonic()


def anchor() -> float:
    return _anchor


def use_anchor(value: float) -> None:
    """Take the agent's anchor (a worker, for every task): one clock for the whole host."""
    global _anchor
    if value:
        _anchor = value
