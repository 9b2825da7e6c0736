"""`hetlaunch report`'s event marks on training.png, from a crafted events.jsonl: 5,000 `lost`
lines took 29 s (a pass over every step per event, a line per event) and 200,000 did not end in
two minutes (a hostile review). Marks are found by bisection, one per kind and step, and at most
MAX_MARKS are drawn, the title saying how many were not."""

from __future__ import annotations

import pytest

from hetlaunch.launcher import report

pytest.importorskip("matplotlib")


def _steps(n: int) -> list[tuple]:
    return [(s, 4.0 - s / n, None, 100.0, [], 1000.0 + s) for s in range(n)]


def test_an_event_marks_the_first_step_recorded_at_or_after_it_once_per_kind_and_step():
    steps = _steps(50)
    events = ([{"event": "lost", "time": 1010.5}] * 1000 + [{"event": "lost", "time": 1010.0}]
              + [{"event": "join", "time": 5000.0}, {"event": "restart", "step": 7}, {"event": "lost", "time": 0}]
              + [{"event": "generation", "start_step": 0}, {"event": "checkpoint", "step": 3}])
    assert report._step_of_events(events, steps) == [("lost", 11), ("lost", 10), ("join", 49), ("restart", 7),
                                                       ("lost", 0)]


def test_at_most_max_marks_are_drawn_and_the_title_says_how_many_were_not(monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    steps = _steps(5000)
    events = [{"event": "lost", "time": 1000.0 + s} for s in range(5000)]
    drawn = {}

    def keep(fig, path):
        drawn["fig"] = fig
        return path
    monkeypatch.setattr(report, "_save", keep)
    report._training(tmp_path / "t.png", steps, events, predicted=None)
    top, bottom = drawn["fig"].axes
    vertical = [line for line in top.lines if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2]
    assert len(vertical) == report.MAX_MARKS
    assert drawn["fig"]._suptitle.get_text() == f"training ({5000 - report.MAX_MARKS:,} more events not marked: see events.jsonl)"
