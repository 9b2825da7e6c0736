"""Make a YAML's `emulate:` knobs true where the profiler and the executor can see them.

One machine stands in for a mixed geo cluster: a node with `speed: 0.25` really takes four
times as long per layer (each piece of compute is followed by a sleep three times as long
as it took), and a link with `bandwidth_mbps`/`latency_ms` really holds each message for
its time on the wire. The planner never reads these knobs; it learns them by measuring,
like real hardware.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hetlaunch.runtime import host_clock


def emulated_speed(emulate, step: int) -> "ComputeEmulation":
    """A stage's compute emulation at a training step: its `speed`, or the last of its
    `speed_changes` (protos Emulation) whose at_step has come."""
    speed = emulate.speed or 1.0
    for change in emulate.speed_changes:
        if step >= change.at_step:
            speed = change.speed
    return ComputeEmulation(speed)


@dataclass(frozen=True)
class ComputeEmulation:
    speed: float = 1.0  # fraction of this device's real speed, in (0, 1]

    def start(self) -> float:
        """Mark the start of a piece of compute (wall clock); pass the mark to `stretch`."""
        return time.perf_counter()

    def stretch(self, started: float, device: torch.device) -> None:
        """Called right after a piece of compute begun at `started`: make it last 1/speed as long.

        The promise: a speed-s node takes 1/s as long as the same node at speed 1 under the same
        conditions, idle or loaded. On a busy machine a speed-1 node gets a share of a core and
        its compute takes c times its CPU time (c >= 1, the contention); a device 1/s times
        slower on that machine would too. So what is stretched is the wall time the compute
        took, whatever slowed it (on CUDA after synchronising, so the kernels have run): a sleep
        of elapsed * (1/s - 1). The ratio then holds under a steady load (up to how the
        scheduler treats a sleeping node, see below), on CPU (one thread or several) and CUDA
        alike, and the sleep burns no CPU, which matters with several agents on a few cores.

        Why not stretch only up to CPU time / speed, so that agents slowing each other down on
        a shared machine do not have that contention multiplied by 1/speed: once load makes the
        wall time exceed CPU time / speed, nothing is added at all, and a speed-0.5 node is no
        slower than a speed-1 node. The price of keeping the promise is that contention during a
        piece of compute (a steady load, a passing burst, other agents computing at the same
        moment) is stretched with it: a slow node loses 1/speed times what it costs, where a
        speed-1 node loses it once, so agents that share too few cores come out slower (and
        noisier) than profiled.

        Not exact on an oversubscribed machine (more busy threads than cores), because the
        scheduler does not treat a node that sleeps between pieces like one that computes
        without a break, as a speed-1 node timing its layers back to back (the profiler) does.
        Per thread, it serves a thread that has been sleeping first, so pieces of a scheduling
        slice or two (a few ms) escape some of the contention: 3 ms pieces beside two busy loops
        on 2 cores came out 1.2-1.8x as slow at speed 0.5 (25 ms pieces: 1.85-2.15x). Across
        sessions (Linux autogroups; agents start their own), the balancer can give a busy node a
        core to itself while a sleeping one shares: profiled pairs beside two busy loops came out
        2.2-3.7x. Two other ways do worse: spinning until this thread's CPU time reaches
        CPU time / speed would make the node as busy as a speed-1 one, but burns the cores the
        other agents need (several agents on two cores at speed 1/8 would spin 7/8 of the time);
        weighting CPU time by runnable threads / cores (/proc/loadavg) overshoots, since on two
        cores every thread that is runnable for an instant counts as half a core of contention
        (beside one busy loop, profiled pairs came out up to 4.5x).
        """
        if self.speed >= 1.0:
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        remaining = started + (now - started) / self.speed - now
        if remaining > 0:
            time.sleep(remaining)


@dataclass
class WireEmulation:
    """The receiving end of an emulated link, one direction.

    A message sent at wall time t occupies the wire after whatever is still on it, for
    wire_bytes / bandwidth, and arrives `latency` later. The receiver sleeps until then, so
    the sender's compute is never held up (as with a real asynchronous send) and bytes
    queue behind each other as on a real link. Sender and receiver share this machine's
    wall clock, which is why emulation is for local agents only.
    """

    bandwidth_bytes_per_s: float  # 0: unlimited
    latency_s: float = 0.0
    _wire_free_at: float = 0.0

    @classmethod
    def from_spec(cls, bandwidth_mbps: float, latency_ms: float, changes: bool = False) -> "WireEmulation | None":
        """None where nothing is emulated (and no bandwidth change is coming)."""
        if bandwidth_mbps <= 0 and latency_ms <= 0 and not changes:
            return None
        return cls(bandwidth_bytes_per_s=bandwidth_mbps * 1e6 / 8 if bandwidth_mbps > 0 else 0.0,
                   latency_s=latency_ms / 1000)

    def at_step(self, link, step: int) -> None:
        """The bandwidth of LinkSpec `link` at a training step: its own, or its last change that has come."""
        mbps = link.emulate_bandwidth_mbps
        for change in link.bandwidth_changes:
            if step >= change.at_step:
                mbps = change.bandwidth_mbps
        self.bandwidth_bytes_per_s = mbps * 1e6 / 8 if mbps > 0 else 0.0

    def arrival(self, sent_at: float, wire_bytes: int) -> float:
        """When a message sent at `sent_at` arrives (host clock), its bytes queued behind the
        ones already on the wire. Counts the message once: call it once per message."""
        on_wire = wire_bytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s > 0 else 0.0
        self._wire_free_at = max(sent_at, self._wire_free_at) + on_wire
        return self._wire_free_at + self.latency_s

    def deliver(self, sent_at: float, wire_bytes: int) -> float:
        """Sleep until a message sent at `sent_at` would have arrived; return the seconds slept."""
        wait = self.arrival(sent_at, wire_bytes) - host_clock.now()
        if wait > 0:
            time.sleep(wait)
        return max(wait, 0.0)
