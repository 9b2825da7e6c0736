"""This host's clock offset to the coordinator's, estimated as NTP does, for aligned timelines.

Each heartbeat is a round trip: the agent notes its wall clock when it sends (t0) and when
the answer arrives (t1), and the answer carries the coordinator's wall clock T. Taking T as
read halfway through the trip, offset = T - (t0 + t1) / 2, wrong by at most half the round
trip minus the coordinator's own time. The sample with the shortest round trip is kept (the
least queueing, so the tightest bound); on one machine that is well under a millisecond.
"""

from __future__ import annotations

import math


class ClockOffset:
    def __init__(self):
        self.offset_s = 0.0
        self.rtt_s = math.inf

    @property
    def known(self) -> bool:
        return math.isfinite(self.rtt_s)

    def sample(self, sent: float, coordinator_time: float, received: float) -> None:
        rtt = received - sent
        if coordinator_time <= 0 or rtt < 0:  # an older coordinator, or the clock stepped back
            return
        if rtt < self.rtt_s:
            self.offset_s, self.rtt_s = coordinator_time - (sent + received) / 2, rtt
