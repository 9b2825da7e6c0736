"""What `hetlaunch up` shows: the plan table, a live progress bar, the final summary."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.run_record import StepRecord


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _link(with_codec: float | None, raw: float | None) -> str:
    if with_codec is None:
        return "-"
    if raw is None or abs(raw - with_codec) < 1e-12:
        return _ms(with_codec)
    return f"{_ms(with_codec)} ({_ms(raw)})"


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_plan(console: Console, plan: Plan) -> None:
    pipelines = plan.pipelines()
    several = len(pipelines) > 1
    shares = "+".join(str(m) for m in plan.pipeline_microbatches)
    table = Table(title=f"plan ({plan.source} cut, {plan.schedule}, {plan.num_microbatches} micro-batches "
                        f"of {plan.micro_batch_size}" + (f" over {len(pipelines)} pipelines: {shares}" if several else "")
                        + ")")
    columns = (("pipe",) if several else ()) + ("stage", "node", "region", "layers", "ms/mb", "codec",
                                                  "link ms (raw)", "GiB used/free")
    for column in columns:
        table.add_column(column, justify="right" if "ms" in column or "GiB" in column else "left", no_wrap=True)
    for p, stages in enumerate(pipelines):
        for i, stage in enumerate(stages):
            last = i == len(stages) - 1
            memory = "-" if stage.memory_bytes is None else f"{_gib(stage.memory_bytes)}/{_gib(stage.capacity_bytes)}"
            link = "-" if last else _link(stage.link_s, stage.link_uncompressed_s)
            table.add_row(*((str(p),) if several else ()), str(i), stage.node, stage.region,
                          f"{stage.layer_start}–{stage.layer_end - 1}", _ms(stage.compute_s),
                          "-" if last else stage.forward_codec, link, memory)
    console.print(table)
    for group in plan.sync_plans():
        timing = "" if group.allreduce_s is None else (f", {_ms(group.allreduce_s)} ms, "
                                                        f"{_ms(group.exposed_s)} ms not hidden by backward")
        console.print(f"  gradient sync layers {group.layer_start}–{group.layer_end - 1}: "
                      f"{' + '.join(group.nodes)} ({group.codec}{timing})")
    if plan.predicted_step_s is not None:
        console.print(f"predicted: {plan.predicted_step_s * 1e3:.1f} ms/step, "
                      f"{plan.predicted_tokens_per_s:,.0f} tokens/s; bottleneck: {plan.bottleneck}")
    for node, why in (plan.excluded or {}).items():
        console.print(f"  [yellow]{node}[/]: {why}")


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
    for link in summary.get("links", []):
        if link["compression_ratio"] > 1.0:
            console.print(f"  link {link['from']} ↔ {link['to']}: {link['raw_bytes'] / 2**20:,.1f} MiB raw, "
                          f"{link['wire_bytes'] / 2**20:,.1f} MiB on the wire ({link['compression_ratio']:.2f}x)")
    for sync in summary.get("gradient_sync", []):
        console.print(f"  gradient sync from {sync['node']}: {sync['raw_bytes'] / 2**20:,.1f} MiB raw, "
                      f"{sync['wire_bytes'] / 2**20:,.1f} MiB on the wire, "
                      f"{sync['mean_blocked_s'] * 1e3:.1f} ms/step blocked")


def planner_result_dict(result) -> dict:
    return {
        "step_s": result.step_s, "tokens_per_s": result.tokens_per_s, "method": result.method,
        "planning_s": result.planning_s, "excluded": result.excluded,
        "pipelines": [{
            "num_microbatches": p.cost.num_microbatches, "step_s": p.cost.step_s, "bottleneck": p.cost.bottleneck,
            "stages": [{"node": s.node, "region": region, "layers": [s.layer_start, s.layer_end],
                        "compute_s": s.compute_s, "codec": s.codec, "link_s": s.link_s,
                        "link_uncompressed_s": s.link_uncompressed_s, "latency_s": s.latency_s,
                        "memory_bytes": s.memory_bytes, "capacity_bytes": s.capacity_bytes}
                       for s, region in zip(p.cost.stages, p.regions)]}
            for p in result.pipelines],
        "sync": [{"layers": [g.layer_start, g.layer_end], "nodes": list(g.nodes), "bytes": g.bytes, "codec": g.codec,
                  "allreduce_s": g.allreduce_s, "exposed_s": g.exposed_s} for g in result.sync],
    }


def print_planner_result(console: Console, profile, result, as_json: bool = False) -> None:
    """`hetlaunch plan`: one table per pipeline, or the same as JSON."""
    if as_json:
        import json

        console.print_json(json.dumps(planner_result_dict(result)))
        return
    for k, p in enumerate(result.pipelines):
        table = Table(title=f"pipeline {k}: {p.cost.num_microbatches} micro-batches of {profile.micro_batch_size}, "
                            f"{p.cost.step_s * 1e3:.1f} ms/step")
        for column in ("stage", "node", "region", "layers", "ms/mb", "codec", "link ms (raw)", "GiB used/free"):
            table.add_column(column, justify="right" if "ms" in column or "GiB" in column else "left", no_wrap=True)
        for i, (s, region) in enumerate(zip(p.cost.stages, p.regions)):
            last = i == len(p.cost.stages) - 1
            table.add_row(str(i), s.node, region, f"{s.layer_start}–{s.layer_end - 1}", _ms(s.compute_s),
                          "-" if last else s.codec, "-" if last else _link(s.link_s, s.link_uncompressed_s),
                          f"{_gib(s.memory_bytes)}/{_gib(s.capacity_bytes)}")
        console.print(table)
        console.print(f"bottleneck: {p.cost.bottleneck}")
    for g in result.sync:
        console.print(f"gradient sync layers {g.layer_start}–{g.layer_end - 1}: {' + '.join(g.nodes)} "
                      f"({g.codec}, {_ms(g.allreduce_s)} ms, {_ms(g.exposed_s)} ms not hidden by backward)")
    console.print(f"predicted: {result.step_s * 1e3:.1f} ms/step, {result.tokens_per_s:,.0f} tokens/s "
                  f"({result.method} search, planned in {result.planning_s:.2f}s)")
    for node, why in result.excluded.items():
        console.print(f"  [yellow]{node}[/]: {why}")
