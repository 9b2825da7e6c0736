"""Run benchmarks, print their figures, save each as bench/results/<name>.json.

    python bench/run.py overhead vs_torch_pipelining     # by name; `all` runs every benchmark
    python bench/run.py all --quick                      # a short smoke run (results go to bench/results/quick/)
    python bench/run.py overhead --times 3               # three consecutive runs, all three kept in the JSON

A benchmark is a module bench/<name>.py (not starting with "_", not a *_worker.py) with
`run(quick: bool, reporter=None) -> dict`. The dict holds its configuration and raw
measurements, and its headline as "figure": {"name", "value", "target"} plus "met".
Side-by-side benchmarks also give "sides" {"a", "b"}, "tokens_per_s" per side, "ratio",
"target" and the ratio of each A/B pair ("pair_ratios"). The runner adds name, date,
machine and duration, writes the file (atomically) and prints one table. With `--times N` a
benchmark runs N times in a row: the file is the last run's, with every run's figure and verdict
under "consecutive", and "met" only where all N met their target.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _harness import BenchError, machine  # noqa: E402

# A pipe or a log gets a table wide enough to read; a terminal keeps its own width.
console = Console() if sys.stdout.isatty() else Console(width=150)


def benchmark_names() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py")
                  if not p.stem.startswith("_") and p.stem != "run" and not p.stem.endswith("_worker"))


class ProgressReporter:
    """Draws one benchmark's progress as a rich progress bar."""

    def __init__(self, progress: Progress, name: str):
        self.progress = progress
        self.name = name
        self.task = progress.add_task(name, total=None)
        self.started = False

    def total(self, runs: int) -> None:
        self.progress.update(self.task, total=runs)

    def total_more(self, runs: int) -> None:
        self.progress.update(self.task, total=(self.progress.tasks[self.task].total or 0) + runs)

    def advance(self, label: str) -> None:
        if self.started:
            self.progress.advance(self.task)
        self.started = True
        self.progress.update(self.task, description=f"{self.name}: {label}")


def write_result(result: dict, out_dir: Path) -> Path:
    """Write atomically, so a reader never sees half a file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{result['name']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def consecutive(runs: list[dict]) -> dict:
    """N runs of one benchmark in a row as one result: the last run's, with each run's date,
    figure and verdict, met only if every run met its target."""
    summary = [{"date": r["date"], "duration_s": r["duration_s"], "figure": (headline(r) or {}).get("value"),
                "met": r.get("met")} for r in runs]
    result = {**runs[-1], "consecutive": summary}
    if all("met" in r for r in runs):
        result["met"] = all(r["met"] for r in runs)
    fig = headline(runs[-1])
    if fig is not None:
        result["figure"] = {**fig, "value": [s["figure"] for s in summary],
                            "name": f"{fig['name']}, {len(runs)} runs in a row"}
    return result


def headline(result: dict) -> dict | None:
    if "figure" in result:
        return result["figure"]
    if "ratio" in result:
        a, b = result["sides"]["a"], result["sides"]["b"]
        return {"name": f"{a} / {b} tokens/s", "value": result["ratio"], "target": f">= {result['target']}"}
    return None


def _value(value) -> str:
    if isinstance(value, (list, tuple)):
        return " / ".join(_value(v) for v in value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _met(result: dict) -> str:
    if "met" not in result:
        return "—"
    return "[green]yes[/]" if result["met"] else "[red]no[/]"


def figures_table(results: list[dict]) -> Table:
    table = Table(title="hetlaunch benchmarks")
    for col, justify in (("benchmark", "left"), ("figure", "left"), ("value", "right"), ("target", "left"),
                         ("met", "center")):
        table.add_column(col, justify=justify)
    for r in results:
        fig = headline(r)
        if fig is None:
            table.add_row(r["name"], "(see the JSON)", "", "", _met(r))
        else:
            table.add_row(r["name"], fig["name"], f"[bold]{_value(fig['value'])}[/]", str(fig["target"]), _met(r))
    return table


def sides_table(results: list[dict]) -> Table:
    """Side-by-side benchmarks: each side's tokens/s, the spread of A/B pairs, how many runs were clean."""
    table = Table(title="side by side (tokens/s: median of per-run steady-state throughput)")
    for col, justify in (("benchmark", "left"), ("side A", "left"), ("tokens/s A", "right"), ("side B", "left"),
                         ("tokens/s B", "right"), ("ratio", "right"), ("pair ratios", "right"),
                         ("p10 step ratio", "right"), ("clean runs A·B", "right")):
        table.add_column(col, justify=justify)
    for r in results:
        a, b = r["sides"]["a"], r["sides"]["b"]
        pairs = r.get("clean_pair_ratios") or r["pair_ratios"]
        reps = r["config"]["reps"]
        table.add_row(r["name"], a, f"{r['tokens_per_s'][a]:,.0f}", b, f"{r['tokens_per_s'][b]:,.0f}",
                      f"{r['ratio']:.3f}", f"{min(pairs):.3f}–{max(pairs):.3f}", f"{r['p10_step_ratio']:.3f}",
                      f"{r['clean_runs'][a]}/{reps}·{r['clean_runs'][b]}/{reps}")
    return table


def main(argv: list[str] | None = None) -> int:
    known = benchmark_names()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", help=f"benchmarks to run: {', '.join(known)}, or all")
    parser.add_argument("--quick", action="store_true", help="short smoke run (results go to bench/results/quick/)")
    parser.add_argument("--times", type=int, default=1, metavar="N",
                        help="run each benchmark N times in a row; the JSON keeps every run's figure")
    args = parser.parse_args(argv)
    names = known if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r} (known: {', '.join(known)}, all)")
    out_dir = BENCH_DIR / "results" / ("quick" if args.quick else "")
    results, failed = [], []
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        for name in names:
            runs = []
            for attempt in range(args.times):
                reporter = ProgressReporter(progress, name if args.times == 1 else f"{name} ({attempt + 1}/{args.times})")
                started = datetime.datetime.now(datetime.timezone.utc)
                try:
                    figures = importlib.import_module(name).run(args.quick, reporter)
                except BenchError as err:
                    progress.console.print(f"[bold red]{name} failed:[/] {err}", soft_wrap=True)
                    break
                finished = datetime.datetime.now(datetime.timezone.utc)
                runs.append({**figures, "name": name, "date": started.isoformat(timespec="seconds"),
                             "quick": args.quick, "machine": machine(),
                             "duration_s": round((finished - started).total_seconds(), 1)})
            if len(runs) < args.times:
                failed.append(name)
                continue
            result = runs[-1] if args.times == 1 else consecutive(runs)
            path = write_result(result, out_dir)
            results.append(result)
            fig = headline(result)
            summary = f"{fig['name']} = {_value(fig['value'])} (target {fig['target']})" if fig else "done"
            progress.console.print(f"{name}: {summary} → {path}", soft_wrap=True)
    if results:
        console.print(figures_table(results))
        side_by_side = [r for r in results if "sides" in r]
        if side_by_side:
            console.print(sides_table(side_by_side))
    if failed:
        console.print(f"[bold red]failed:[/] {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # every process a side started has been stopped on the way out
        console.print("[bold red]interrupted[/]")
        sys.exit(130)
