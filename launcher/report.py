"""`hetlaunch report runs/<id>`: pictures of a run (matplotlib, the `plots` extra).

Three PNGs in runs/<id>/report/ (or -o DIR), made from the files the run wrote:

* training.png — loss (and eval loss, and each island's loss with islands) and tokens/s over the steps (beside the last plan's
  predicted tokens/s), with the run's events (restarts, lost and joined nodes, re-plans)
  marked where they happened;
* plan.png — the last generation's plan: one row per stage, grouped by pipeline and
  coloured by region, each a bar over the layers it holds, with the codec and the
  predicted transfer time on every boundary;
* stages.png — per stage, the planner's predicted compute and transfer per micro-batch
  beside what training measured (the median over the steps after the first of its compute
  and of its time blocked on the data plane, each divided by its pipeline's micro-batches; on a
  run of more than STAGE_ROWS_READ steps, over that many of them, evenly spaced).

Nothing is read from the run but JSON; a file that is missing, too large or not ours is one
line naming it.
"""

from __future__ import annotations

import bisect
import json
import statistics
from pathlib import Path

from hetlaunch.runtime.files import UnreadableFile, read_regular_file, write_whole

MAX_FILE_BYTES = 256 << 20
STAGE_ROWS_READ = 20_000  # stages.png's medians: over at most this many steps' stage rows, evenly spaced
_STAGES_KEY = ', "stages": '  # how RunRecord writes a row's last field (json.dumps' separators)
_NO_STAGES = object()  # a row without stage rows: not one of ours
# What RunRecord writes in every row before its stage rows: a row whose part before them lacks one
# was not written that way (keys sorted by a tool, stages first) and is read whole, so that no
# field after the stage rows is lost.
_WRITTEN_BEFORE_STAGES = frozenset({"step", "loss", "tokens_per_s", "step_s", "time"})
MAX_DRAWN_STAGES = 1024  # plan.png and stages.png: a row a stage (20,000 took minutes and 1.3 GB)
MAX_MARKS = 200  # events marked on training.png (5,000 took 29 s; a real run has a handful)
_MARKED = {"restart": "restart", "lost": "lost", "join": "join", "generation": "new plan", "resume": "resume"}


class ReportError(Exception):
    """One line: why no report was made."""


def _lines(path: Path) -> list[dict]:
    lines = _read(path).splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        value = _line_object(path, line, number, len(lines))
        if value is None:
            break
        out.append(value)
    return out


def _line_object(path: Path, line: str, number: int, total: int) -> dict | None:
    """A JSON lines file's line `number` of `total`: its object, or None for a last line a crash cut
    off; ReportError for any other line that is not a JSON object."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: a line nested thousands deep
        if number == total:
            return None
        raise ReportError(f"{path}: line {number} is not JSON") from None
    if not isinstance(value, dict):
        raise ReportError(f"{path}: line {number} is not a JSON object")
    return value


def _metric_rows(path: Path) -> list[tuple[dict, list | None]]:
    """metrics.jsonl's rows as (the step's own fields, its stage rows or None). A row's stage rows
    (RunRecord writes them last) are most of its bytes and of its reading, and only stages.png's
    medians use them: they are read for at most STAGE_ROWS_READ rows, evenly spaced, and the
    rest of each row alone. A 200 MB file of 178,000 steps took 34 s and 1.7 GB read whole.
    Unsampled rows are trusted past that cut: a line broken inside its stage rows is said only
    where they are read, and a field a hand-made row puts after them, beyond those every row
    has before them, is not read."""
    lines = _read(path).splitlines()
    every = max(1, -(-len(lines) // STAGE_ROWS_READ))  # rounded up: at most STAGE_ROWS_READ (and step 1's)
    out = []
    for number, line in enumerate(lines, 1):
        cut = line.find(_STAGES_KEY) if line.endswith("]}") else -1
        row = stages = None
        if cut > 0:
            try:
                row = json.loads(line[:cut] + "}")
                if (number - 1) % every == 0 or number == 2:  # step 1's: stages.png reads the steps after the first
                    stages = json.loads(line[cut + len(_STAGES_KEY):-1])
            except (ValueError, RecursionError):
                row = None
        if not (isinstance(row, dict) and _WRITTEN_BEFORE_STAGES <= row.keys()) or (stages is not None
                                                                                  and not isinstance(stages, list)):
            row = _line_object(path, line, number, len(lines))  # not as RunRecord writes a row: the whole line
            if row is None:
                break
            stages = row.pop("stages", _NO_STAGES)
        out.append((row, stages))
    if any(stages is _NO_STAGES for _, stages in out):  # said once every line is JSON (a broken line first)
        raise ReportError(f"{path}: not a hetlaunch metrics file")
    return out


def _read(path: Path) -> str:
    try:  # a FIFO in a run file's place is refused, not waited on
        return read_regular_file(path, MAX_FILE_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (is {path.parent} a run directory?)") from None
    except UnreadableFile as err:
        raise ReportError(f"{path}: {err}") from None


def make_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the PNGs; return their paths. ReportError on a run directory it cannot read."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError("hetlaunch report needs matplotlib: pip install 'hetlaunch[plots]'") from None
    matplotlib.use("Agg")  # files only, no display
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    metrics = _metric_rows(run_dir / "metrics.jsonl")
    if not metrics:
        raise ReportError(f"{run_dir / 'metrics.jsonl'}: no steps recorded yet")
    try:
        steps = [(int(r["step"]), r.get("loss"), r.get("eval_loss"), float(r["tokens_per_s"]), stages,
                  float(r.get("time", 0.0))) for r, stages in metrics]
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: a step of 1e400
        raise ReportError(f"{run_dir / 'metrics.jsonl'}: not a hetlaunch metrics file") from None
    events = _lines(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    summary_path = run_dir / "summary.json"
    plan = None
    if summary_path.exists():
        try:
            summary = json.loads(_read(summary_path))
        except (ValueError, RecursionError):
            raise ReportError(f"{summary_path}: not JSON") from None
        if not isinstance(summary, dict):  # null or [] is JSON, but not a summary (it was called "not JSON")
            raise ReportError(f"{summary_path}: not a summary hetlaunch wrote (a JSON object)")
        plan = summary.get("plan")
    if plan is None:  # a run still going (or killed): its last generation's plan from the events
        plan = next((e.get("plan") for e in reversed(events) if e.get("event") == "generation"), None)
    if plan is not None and not (isinstance(plan, dict) and isinstance(plan.get("stages"), list)):
        raise ReportError(f"{summary_path}: its plan is not one hetlaunch wrote")
    if out_dir is None:
        out_dir = run_dir / "report"
        if out_dir.is_symlink():  # a run directory handed over could point it at any folder of the user's
            raise ReportError(f"{out_dir}: is a link, not the report folder this run wrote; name one with -o")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"cannot write {out_dir}: {err.strerror or err}") from None
    islands = [(int(r["step"]), r["islands"].get("losses") or []) for r, _ in metrics if isinstance(r.get("islands"), dict)]
    del metrics
    try:
        written = [_training(out_dir / "training.png", steps, events, (plan or {}).get("predicted_tokens_per_s"),
                             islands)]
        if plan and len(plan["stages"]) > MAX_DRAWN_STAGES:
            raise ReportError(f"{summary_path}: its plan has {len(plan['stages']):,} stages, more than the "
                              f"{MAX_DRAWN_STAGES:,} plan.png draws (training.png is written)")
        if plan:
            written.append(_plan(out_dir / "plan.png", plan))
            written.append(_stages(out_dir / "stages.png", plan, steps))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, ZeroDivisionError, IndexError):
        # a layer_end of 10**400, 0 micro-batches, a stage of a pipeline the plan does not have
        raise ReportError(f"{run_dir}: its records are not ones hetlaunch wrote") from None
    except OSError as err:  # the PNG's place taken (a directory), a full disk
        raise ReportError(f"cannot write {out_dir}: {err.strerror or err}") from None
    return written


def _save(fig, path: Path) -> Path:
    """Drawn in memory, then written whole (write_whole's own new temp file): a fixed temp name
    beside it was followed where a link stood there (a run directory handed over could point it
    at any file of the user's) and stayed behind when the save was interrupted."""
    import io

    import matplotlib.pyplot as plt

    png = io.BytesIO()
    try:
        fig.savefig(png, dpi=110, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    write_whole(path, png.getvalue())
    return path


def _training(path: Path, steps, events, predicted: float | None, islands=()) -> Path:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    xs = [s for s, *_ in steps]
    top.plot(xs, [loss if isinstance(loss, (int, float)) else float("nan") for _, loss, *_ in steps], label="loss")
    for i in range(max((len(losses) for _, losses in islands), default=0)):  # islands: each one's own loss
        curve = [(s, losses[i]) for s, losses in islands if i < len(losses) and isinstance(losses[i], (int, float))]
        if curve:
            top.plot(*zip(*curve), lw=0.8, alpha=0.6, label=f"island {i}")
    evals = [(s, e) for s, _, e, *_ in steps if isinstance(e, (int, float))]
    if evals:
        top.plot(*zip(*evals), "o-", label="eval loss")
    top.set_ylabel("loss")
    top.legend(loc="upper right")
    bottom.plot(xs, [t for _, _, _, t, _, _ in steps], color="tab:green", label="measured")
    if isinstance(predicted, (int, float)):
        bottom.axhline(predicted, color="tab:green", ls="--", alpha=0.7, label="predicted (last plan)")
    bottom.legend(loc="lower right", fontsize=7)
    bottom.set_ylabel("tokens/s")
    bottom.set_xlabel("step")
    marks = _step_of_events(events, steps)
    for event, step in marks[:MAX_MARKS]:
        for ax in (top, bottom):
            ax.axvline(step, color="tab:red" if event in ("restart", "lost") else "tab:gray", alpha=0.5, lw=1)
        top.annotate(_MARKED[event], (step, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                     va="top", ha="right")
    more = f" ({len(marks) - MAX_MARKS:,} more events not marked: see events.jsonl)" if len(marks) > MAX_MARKS else ""
    fig.suptitle("training" + more, y=1.0)
    return _save(fig, path)


def _step_of_events(events, steps) -> list[tuple[str, int]]:
    """Events worth marking, at the step they happened: their own step field, else the first step
    recorded after their time."""
    times = sorted((when, s) for s, *_, when in steps)
    whens = [t for t, _ in times]
    marked, seen = [], set()
    for e in events:
        kind = e.get("event")
        if kind not in _MARKED or (kind == "generation" and e.get("start_step", 0) == 0):
            continue
        step = e.get("step", e.get("start_step"))
        if not isinstance(step, int):
            when = e.get("time", 0)
            if not isinstance(when, (int, float)):
                continue  # an event without a step or a time: nowhere to mark it
            at = bisect.bisect_left(whens, when)  # the first step recorded at or after it
            step = times[at][1] if at < len(times) else steps[-1][0]
        if (kind, step) not in seen:  # one mark per kind and step: a crafted log repeated them by the thousand
            seen.add((kind, step))
            marked.append((kind, step))
    return marked


def _plan(path: Path, plan: dict) -> Path:
    import matplotlib.pyplot as plt

    stages = plan["stages"]
    regions = sorted({s["region"] for s in stages})
    colours = {r: plt.cm.tab10(i % 10) for i, r in enumerate(regions)}
    fig, ax = plt.subplots(figsize=(9, 0.5 * len(stages) + 1.5))
    for row, s in enumerate(stages):
        y = len(stages) - 1 - row
        ax.barh(y, s["layer_end"] - s["layer_start"], left=s["layer_start"], color=colours[s["region"]],
                edgecolor="black")
        compute = f", {s['compute_s'] * 1e3:.1f} ms/mb" if s.get("compute_s") is not None else ""
        ax.text(s["layer_start"] + 0.1, y, f"{s['node']}{compute}", va="center", fontsize=8)
        nxt = stages[row + 1] if row + 1 < len(stages) and stages[row + 1]["pipeline"] == s["pipeline"] else None
        if nxt is not None:
            link = f" {s['link_s'] * 1e3:.1f} ms" if s.get("link_s") is not None else ""
            ax.annotate(f"{s['forward_codec']}{link}", (s["layer_end"], y - 0.5), fontsize=7, ha="center",
                        va="center", color="tab:blue")
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"p{s['pipeline']} stage {j}" for j, s in reversed(list(enumerate(stages)))], fontsize=8)
    ax.set_xlabel("layers")
    ax.set_xlim(0, plan["num_layers"])
    for r in regions:
        ax.barh(0, 0, color=colours[r], label=r)
    ax.legend(title="region", loc="lower right", fontsize=7)
    predicted = plan.get("predicted_tokens_per_s")
    ax.set_title(f"plan ({plan['source']}, {plan['schedule']}, {plan['num_microbatches']} micro-batches of "
                 f"{plan['micro_batch_size']})" + (f": predicted {predicted:,.0f} tokens/s" if predicted else ""))
    return _save(fig, path)


def _stages(path: Path, plan: dict, steps) -> Path:
    """Predicted vs measured compute and communication per micro-batch, per stage."""
    import matplotlib.pyplot as plt

    shares = plan.get("pipeline_microbatches") or [plan["num_microbatches"]]
    later = [stages for _, _, _, _, stages, _ in steps[1:] if stages is not None] or [steps[0][4]]
    by_node: dict[str, list[dict]] = {}  # indexed once: per plan stage a pass over every step row was quadratic
    for stages in later:
        for st in stages:
            by_node.setdefault(st.get("node"), []).append(st)
    labels, predicted, measured = [], [], []
    for p_stage in plan["stages"]:
        node, share = p_stage["node"], shares[p_stage["pipeline"]]
        mine = by_node.get(node, [])
        labels.append(f"{node}")
        predicted.append(((p_stage.get("compute_s") or 0.0) * 1e3, (p_stage.get("link_s") or 0.0) * 1e3))
        measured.append((statistics.median(st["compute_s"] for st in mine) / share * 1e3 if mine else 0.0,
                         statistics.median(st["comm_s"] for st in mine) / share * 1e3 if mine else 0.0))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.4 * len(labels) + 2), sharey=True)
    ys = range(len(labels))
    for ax, k, title in ((left, 0, "compute per micro-batch (ms)"), (right, 1, "communication per micro-batch (ms)")):
        ax.barh([y + 0.2 for y in ys], [p[k] for p in predicted], height=0.4, label="predicted")
        ax.barh([y - 0.2 for y in ys], [m[k] for m in measured], height=0.4, label="measured")
        ax.set_title(title, fontsize=9)
    left.set_yticks(list(ys))
    left.set_yticklabels(labels, fontsize=8)
    left.invert_yaxis()
    left.legend(fontsize=7)
    fig.suptitle("per stage: the plan's prediction and what training measured", y=1.04)
    return _save(fig, path)
