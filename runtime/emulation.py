"""Make a YAML's `emulate:` knobs true where the profiler and the executor can see them.

One machine stands in for a mixed geo cluster: a node with `speed: 0.25` really takes four
times as long per layer (its compute is followed by a sleep), and a link with
`bandwidth_mbps`/`latency_ms` really holds each message for its time on the wire. The
planner never reads these knobs; it learns them by measuring, like real hardware.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ComputeEmulation:
    speed: float = 1.0  # fraction of this device's real speed, in (0, 1]

    def start(self) -> tuple[float, float]:
        """Mark the start of a piece of compute: (wall clock, this thread's CPU clock)."""
        return time.perf_counter(), time.thread_time()

    def stretch(self, started: tuple[float, float], device: torch.device) -> None:
        """Called right after a piece of compute begun at `started`: make it last work / speed.

        On a single-threaded CPU stage the work is the CPU time this thread spent, not the wall
        time: agents that share a machine slow each other down, and stretching that contention
        by 1/speed would turn a little noise into a lot. Elsewhere the work is the wall time
        (on CUDA after synchronising, so the kernels have run).
        """
        if self.speed >= 1.0:
            return
        wall_start, cpu_start = started
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            work = time.perf_counter() - wall_start
        elif torch.get_num_threads() == 1:
            work = time.thread_time() - cpu_start
        else:
            work = time.perf_counter() - wall_start
        remaining = work / self.speed - (time.perf_counter() - wall_start)
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
    def from_spec(cls, bandwidth_mbps: float, latency_ms: float) -> "WireEmulation | None":
        if bandwidth_mbps <= 0 and latency_ms <= 0:
            return None
        return cls(bandwidth_bytes_per_s=bandwidth_mbps * 1e6 / 8 if bandwidth_mbps > 0 else 0.0,
                   latency_s=latency_ms / 1000)

    def deliver(self, sent_at: float, wire_bytes: int) -> float:
        """Sleep until a message sent at `sent_at` would have arrived; return the seconds slept."""
        on_wire = wire_bytes / self.bandwidth_bytes_per_s if self.bandwidth_bytes_per_s > 0 else 0.0
        self._wire_free_at = max(sent_at, self._wire_free_at) + on_wire
        wait = self._wire_free_at + self.latency_s - time.time()
        if wait > 0:
            time.sleep(wait)
        return max(wait, 0.0)
