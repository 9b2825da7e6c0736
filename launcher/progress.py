"""What `hetlaunch up` shows: the plan table, a live progress bar, the final summary."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from hetlaunch.launcher.plan import Plan
from hetlaunch.launcher.run_record import StepRecord


def print_plan(console: Console, plan: Plan) -> None:
    table = Table(title=f"plan ({plan.source} cut, {plan.schedule}, {plan.num_microbatches} micro-batches "
                        f"of {plan.micro_batch_size})")
    for column in ("stage", "node", "region", "layers", "codec →"):
        table.add_column(column)
    for i, stage in enumerate(plan.stages):
        codec = stage.forward_codec if i < len(plan.stages) - 1 else "-"
        table.add_row(str(i), stage.node, stage.region, f"{stage.layer_start}–{stage.layer_end - 1}", codec)
    console.print(table)


class TrainingProgress:
    """A rich progress bar with step, loss and tokens/s."""

    def __init__(self, console: Console, total_steps: int):
        self.progress = Progress(
            TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[green]{task.fields[tps]}[/] tok/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)
        self.task = self.progress.add_task("train", total=total_steps, loss="-", tps="-")

    def __enter__(self) -> "TrainingProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, record: StepRecord) -> None:
        self.progress.update(self.task, completed=record.step + 1, loss=f"{record.loss:.4f}",
                             tps=f"{record.tokens_per_s:,.0f}")


def print_summary(console: Console, summary: dict, run_dir: Path) -> None:
    console.print(f"[bold green]done[/]: {summary['steps']} steps in {summary['wall_s']:.1f}s, "
                  f"loss {summary.get('first_loss', float('nan')):.4f} → {summary.get('final_loss', float('nan')):.4f}, "
                  f"{summary.get('mean_tokens_per_s', 0):,.0f} tokens/s; metrics in {run_dir}/metrics.jsonl")
