"""The bubble fraction of sampled steps, read from a run's trace.json (launcher/timeline.py).

For one step of one pipeline: the window runs from the first scheduled action's start to the
last one's end over all its stages (F, B, I, W and E spans; the optimizer and the gradient sync
after them are not the schedule's), and each stage is busy for its actions' time less the waits
for a message nested inside them (a forward's `recv` span lies inside its `F` span). The bubble
fraction is the share of stages × window that no action kept busy: what the ZB paper calls the
bubble rate. The predicted tracks (the planner's simulation of the same step) have no waits and
are measured the same way, so measured and predicted compare like for like.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hetlaunch.launcher.timeline import PREDICTED_PID

ACTION = re.compile(r"^[FBIWE]\d+$")


def bubble_fractions(trace_path: Path, from_step: int = 0) -> dict[str, list[float]]:
    """{"measured": [...], "predicted": [...]}: one bubble fraction per sampled step >= from_step
    and pipeline, in step order."""
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("ph") == "X"]
    out: dict[str, list[float]] = {"measured": [], "predicted": []}
    steps = sorted({e["args"]["step"] for e in events if e["args"]["step"] >= from_step})
    for step in steps:
        in_step = [e for e in events if e["args"]["step"] == step]
        for pid in sorted({e["pid"] for e in in_step}):
            key = "predicted" if pid >= PREDICTED_PID else "measured"
            fraction = _bubble([e for e in in_step if e["pid"] == pid])
            if fraction is not None:
                out[key].append(fraction)
    return out


def _bubble(events: list[dict]) -> float | None:
    actions = [e for e in events if ACTION.match(e["name"])]
    if not actions:
        return None
    start = min(e["ts"] for e in actions)
    end = max(e["ts"] + e["dur"] for e in actions)
    stages = {e["tid"] for e in actions}
    busy = 0.0
    for tid in stages:
        mine = [e for e in actions if e["tid"] == tid]
        waits = [e for e in events if e["tid"] == tid and e["name"] == "recv"]
        busy += sum(a["dur"] for a in mine) - sum(_overlap(a, w) for a in mine for w in waits)
    window = (end - start) * len(stages)
    return 1.0 - busy / window if window > 0 else None


def _overlap(a: dict, b: dict) -> float:
    return max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]))
