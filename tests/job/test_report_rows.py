"""`hetlaunch report` reads metrics.jsonl's rows without their stage rows, but for an evenly spaced
sample (report._metric_rows): a 200 MB file of 178,000 steps took 34 s and 1.7 GB read whole. What
it reads must be what the whole lines say, for rows as RunRecord writes them and for rows that
are not (read whole then)."""

from __future__ import annotations

import json

import pytest

from hetlaunch.launcher import report
from hetlaunch.launcher.run_record import RunRecord, StepRecord


def _write(run_dir, n: int) -> list[str]:
    record = RunRecord(run_dir)
    for s in range(n):
        islands = {"losses": [1.0, 2.0], "stages": [s]} if s % 5 == 0 else None  # ', "stages": ' before the stage rows
        record.add(StepRecord(step=s, loss=2.0 - s / n, tokens_per_s=100.0 + s, step_s=0.1, time=1000.0 + s,
                              eval_loss=1.5 if s % 4 == 0 else None, islands=islands,
                              stages=[{"node": f"n{j}", "compute_s": 0.01 * (s + j), "comm_s": 0.002} for j in range(3)]))
    record.close()
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def test_each_rows_own_fields_are_the_whole_lines_and_stage_rows_an_even_sample(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "STAGE_ROWS_READ", 7)
    lines = _write(tmp_path, 50)
    rows = report._metric_rows(tmp_path / "metrics.jsonl")
    assert len(rows) == 50
    sampled = []
    for line, (own, stages) in zip(lines, rows):
        whole = json.loads(line)
        assert own == {k: v for k, v in whole.items() if k != "stages"}
        if stages is not None:
            assert stages == whole["stages"]
            sampled.append(whole["step"])
    # every 8th (50 / 7 rounded up: at most 7) and step 1 (stages.png reads the steps after the
    # first); a row whose islands hold the marker first is not as RunRecord writes them: read whole
    assert sampled == sorted({1, *range(0, 50, 8), *range(0, 50, 5)})


def test_with_few_rows_every_stage_row_is_read(tmp_path):
    lines = _write(tmp_path, 30)
    rows = report._metric_rows(tmp_path / "metrics.jsonl")
    assert [stages for _, stages in rows] == [json.loads(line)["stages"] for line in lines]


def test_a_broken_stage_row_is_said_where_it_is_read_and_a_cut_last_line_is_left_out(tmp_path, monkeypatch):
    lines = _write(tmp_path, 30)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines[:29] + [lines[29][:-40]]) + "\n")  # a crash cut the last line
    assert [own["step"] for own, _ in report._metric_rows(path)] == list(range(29))
    broken = lines[:]
    broken[3] = broken[3].replace('"compute_s": ', '"compute_s": nope', 1)
    path.write_text("\n".join(broken) + "\n")
    with pytest.raises(report.ReportError, match="line 4 is not JSON"):
        report._metric_rows(path)


def test_a_row_with_fields_after_its_stage_rows_is_read_whole(tmp_path, monkeypatch):
    """A tool that rewrote the rows with "stages" second and a list last (the line still ends in
    "]}"): cut at the stage rows, a row lost tokens_per_s and time, and the report said the file
    was not hetlaunch's (a review)."""
    lines = _write(tmp_path, 30)
    moved = []
    for line in lines:
        row = json.loads(line)
        step, stages = row.pop("step"), row.pop("stages")
        moved.append({"step": step, "stages": stages, **row, "missing": ["n9"]})
    monkeypatch.setattr(report, "STAGE_ROWS_READ", 7)  # the rows not sampled are the ones cut
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in moved))
    assert all(json.dumps(row).endswith("]}") for row in moved)
    rows = report._metric_rows(path)
    assert [own for own, _ in rows] == [{k: v for k, v in row.items() if k != "stages"} for row in moved]
    assert [stages for _, stages in rows] == [row["stages"] for row in moved]


def test_a_report_folder_that_is_a_link_is_refused_and_what_it_points_at_is_left_alone(tmp_path):
    """A run directory someone handed over, its report/ a link to a folder of the user's: report
    wrote its PNGs there, over the user's own plan.png (a review)."""
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write(run_dir, 5)
    victim = tmp_path / "mine"
    victim.mkdir()
    (victim / "training.png").write_bytes(b"the user's own file")
    (run_dir / "report").symlink_to(victim)
    with pytest.raises(report.ReportError, match="report: is a link, not the report folder this run wrote"):
        report.make_report(run_dir)
    assert (victim / "training.png").read_bytes() == b"the user's own file"
    assert report.make_report(run_dir, tmp_path / "out")  # -o naming a folder: drawn there
