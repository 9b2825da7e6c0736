"""What `hetlaunch up` shows: the plan table, a live progress bar, the final summary.

Node names, regions, reasons and paths come from the user or from errors: they are printed as
plain text (rich `Text`, or `markup=False` and `emoji=False`), never parsed as markup, so a
`[...]` or `:name:` in them shows verbatim.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from hetlaunch.launcher.planning.batch_sizes import describe
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.planner import format_bytes

if TYPE_CHECKING:  # run_record imports the live session (torch, grpc); `plan --profile` must not
    from hetlaunch.launcher.run_record import StepRecord


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _link(with_codec: float | None, raw: float | None) -> str:
    if with_codec is None:
        return "-"
    if raw is None or abs(raw - with_codec) < 1e-12:
        return _ms(with_codec)
    return f"{_ms(with_codec)} ({_ms(raw)})"


def _memory(used: float | None, capacity: float | None) -> str:
    """The "memory used/free" cell: each side in the unit that fits (12.3 MiB/4.00 GiB)."""
    return "-" if used is None else f"{format_bytes(used)}/{format_bytes(capacity)}"


def _plain(console: Console, text: str) -> Text:
    """User or error text as rich Text: no markup, no emoji codes; highlighted as console.print would."""
    return console.render_str(text, markup=False, emoji=False)


def _say(console: Console, text: str) -> None:
    console.print(_plain(console, text))


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=Text(title, style="table.title"))
    for column in columns:
        table.add_column(column, no_wrap=True,
                         justify="right" if "ms" in column or "memory" in column else "left")
    return table


def _row(table: Table, *cells: str) -> None:
    table.add_row(*(Text(cell) for cell in cells))


def _excluded(console: Console, excluded: dict[str, str]) -> None:
    for node, why in excluded.items():
        console.print(Text.assemble("  ", (node, "yellow"), ": ", _plain(console, why)))


def print_plan(console: Console, plan: Plan) -> None:
    pipelines = plan.pipelines()
    several = len(pipelines) > 1
    shares = "+".join(str(m) for m in plan.pipeline_microbatches)
    table = _table(f"plan ({plan.source} cut, {plan.schedule}, {plan.num_microbatches} micro-batches "
                   f"of {plan.micro_batch_size}" + (f" over {len(pipelines)} pipelines: {shares}" if several else "")
                   + ")",
                   (("pipe",) if several else ()) + ("stage", "node", "region", "layers", "ms/mb", "codec",
                                                      "link ms (raw)", "memory used/free"))
    for p, stages in enumerate(pipelines):
        for i, stage in enumerate(stages):
            last = i == len(stages) - 1
            link = "-" if last else _link(stage.link_s, stage.link_uncompressed_s)
            _row(table, *((str(p),) if several else ()), str(i), stage.node, stage.region,
                 f"{stage.layer_start}–{stage.layer_end - 1}", _ms(stage.compute_s),
                 "-" if last else stage.forward_codec, link, _memory(stage.memory_bytes, stage.capacity_bytes))
    console.print(table)
    for group in plan.sync_plans():
        timing = "" if group.allreduce_s is None else (f", {_ms(group.allreduce_s)} ms, "
                                                        f"{_ms(group.exposed_s)} ms not hidden by backward")
        _say(console, f"  gradient sync layers {group.layer_start}–{group.layer_end - 1}: "
                      f"{' + '.join(group.nodes)} ({group.codec}{', by region' if group.hierarchical else ''}{timing})")
    if plan.outer is not None:
        _islands(console, plan)
    if plan.predicted_step_s is not None:
        _say(console, f"predicted: {plan.predicted_step_s * 1e3:.1f} ms/step, "
                      f"{plan.predicted_tokens_per_s:,.0f} tokens/s; bottleneck: {plan.bottleneck}")
    if plan.schedule_choice:
        _say(console, f"schedule {plan.schedule} ({plan.schedule_choice})")
    if plan.batch_note:
        _say(console, plan.batch_note)
    if plan.contention_note:
        _say(console, plan.contention_note)
    _excluded(console, plan.excluded or {})


LOG_LINES = 20  # not on a terminal: about this many progress lines per run


class TrainingProgress:
    """A rich progress bar with step, loss and tokens/s on a terminal. Elsewhere (a log file, a
    pipe, systemd) a plain line every ~5% of the run, and no refresh thread taking the
    coordinator's CPU from the job."""

    def __init__(self, console: Console, total_steps: int, completed: int = 0):
        self.console = console
        self.live = console.is_terminal
        self.total = total_steps
        self.every = max(1, total_steps // LOG_LINES)
        self.progress = Progress(
            TextColumn("[bold]{task.fields[status]}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[green]{task.fields[tps]}[/] tok/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False, disable=not self.live)
        self.task = self.progress.add_task("train", total=total_steps, completed=completed, loss="-", tps="-",
                                           status="training")

    def recovering(self, why: str, completed: int) -> None:
        """Say that the job is recovering (and why, on its own line), back to the step it resumes at."""
        self.console.print(Text(f"recovering: {why}"))
        self.progress.update(self.task, completed=completed, status="recovering")

    def rebalancing(self, why: str, completed: int | None = None) -> None:
        """Say that the job changes its plan to train faster (and why): a change, not a failure;
        `completed`: the step it resumes at, when it restarts."""
        self.console.print(Text(f"rebalancing: {why}"))
        if completed is not None:
            self.progress.update(self.task, completed=completed, status="rebalancing")

    def __enter__(self) -> "TrainingProgress":
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live:
            self.progress.stop()

    def update(self, record: StepRecord) -> None:
        if not self.live:
            done = record.step + 1
            if done % self.every == 0 or done == self.total:
                self.console.print(Text(f"step {done}/{self.total}  loss {record.loss:.4f}  "
                                        f"{record.tokens_per_s:,.0f} tokens/s"))
            return
        self.progress.update(self.task, completed=record.step + 1, loss=f"{record.loss:.4f}",
                             tps=f"{record.tokens_per_s:,.0f}", status="training")


def print_summary(console: Console, summary: dict, run_dir: Path) -> None:
    console.print(Text.assemble(("done", "bold green"), _plain(
        console,
        f": {summary['steps']} steps in {summary['wall_s']:.1f}s, "
        f"loss {summary.get('first_loss', float('nan')):.4f} → {summary.get('final_loss', float('nan')):.4f}, "
        f"{summary.get('mean_tokens_per_s', 0):,.0f} tokens/s; metrics in {run_dir}/metrics.jsonl")))
    for link in summary.get("links", []):
        if link["compression_ratio"] > 1.0:
            _say(console, f"  link {link['from']} ↔ {link['to']}: {link['raw_bytes'] / 2**20:,.1f} MiB raw, "
                          f"{link['wire_bytes'] / 2**20:,.1f} MiB on the wire ({link['compression_ratio']:.2f}x)")
    for sync in summary.get("gradient_sync", []):
        _say(console, f"  gradient sync from {sync['node']}: {sync['raw_bytes'] / 2**20:,.1f} MiB raw, "
                      f"{sync['wire_bytes'] / 2**20:,.1f} MiB on the wire, "
                      f"{sync['mean_blocked_s'] * 1e3:.1f} ms/step blocked")
    if summary.get("dropped_reports"):
        _say(console, f"  {summary['dropped_reports']:,} step report(s) dropped: more were waiting for the coordinator "
                      f"than it keeps (an agent sent far more than a job's steps)")
    _memory_summary(console, summary.get("memory"))
    outer = summary.get("outer")
    if outer:
        losses = ", ".join("-" if x is None else f"{x:.4f}" for x in outer["final_island_losses"])
        _say(console, f"  outer steps: {outer['exchanges_launched']} exchanges, {outer['wire_bytes'] / 2**20:,.1f} MiB "
                      f"between islands ({outer['wire_bytes_per_token']:.2f} bytes/token), {outer['blocked_s']:.1f}s "
                      f"waited for; " + (f"last island losses {losses}" if losses else "the run ended synchronously"))


def _memory_summary(console: Console, memory: dict | None) -> None:
    """Per stage: the plan's predicted memory → the measured peak of tensors in use (of which
    saved activations); per pipeline, the first stage's peak activations ÷ the last's."""
    if not memory or not memory["stages"]:
        return
    several = len(memory["activation_balance"]) > 1
    _say(console, "  memory per stage, predicted → measured peak tensors (of which activations saved for "
                  "backward; not the process's RSS):")
    for s in memory["stages"]:
        where = (f"pipeline {s['pipeline']} " if several else "") + f"stage {s['stage']} {s['node']}"
        _say(console, f"    {where}: {format_bytes(s['predicted_bytes'])} → {format_bytes(s['peak_used_bytes'])} "
                      f"({format_bytes(s['peak_activation_bytes'])})")
    balance = ", ".join("-" if b is None else f"{b:.2f}" for b in memory["activation_balance"])
    by_node = len({s["node"] for s in memory["stages"]}) < len(memory["stages"])  # several stages per node
    ends = "first node's peak activations ÷ the last node's" if by_node else "first stage's peak activations ÷ the last's"
    _say(console, f"  memory balance ({ends}"
                  f"{', per pipeline' if several else ''}): {balance}")


def print_calibration(console: Console, calibration: dict) -> None:
    """One line per finding of launcher/adapt/calibration.py."""
    if "error" in calibration:
        _say(console, f"calibration: {calibration['error']}")
        return
    factors = ", ".join(f"{n} {f:.2f}x" for n, f in calibration["node_speed_factors"].items())
    first, last = calibration["steps"]
    _say(console, f"calibration (steps {first}–{last}): measured compute ÷ predicted per node: {factors}")
    links = calibration.get("link_transit_factors") or {}
    if links:
        corrected = calibration.get("links_corrected") or {}
        _say(console, "  measured transit ÷ predicted per link: " + ", ".join(
            f"{link} {f:.2f}x" + (f" (now {corrected[link]:,.1f} Mbit/s)" if link in corrected else "")
            for link, f in links.items()))
    line = (f"  predicted {_ms(calibration['predicted_step_s'])} ms/step, calibrated "
            f"{_ms(calibration['calibrated_step_s'])} + {_ms(calibration['unexplained_step_s'])} ms unexplained, "
            f"measured {_ms(calibration['measured_step_s'])} ms")
    after = calibration.get("after_window")
    if after:
        line += (f"; on the {after['steps']} later steps the prediction was off by {after['error_before']:+.0%} "
                 f"before calibration and {after['error_calibrated']:+.1%} after")
    _say(console, line)


def _islands(console: Console, plan: Plan) -> None:
    """Which pipelines train together, and how often and at what cost the islands meet."""
    pipelines = plan.pipelines()
    for i, (members, m) in enumerate(zip(plan.island_members(), plan.island_microbatches())):
        nodes = sorted({s.node for p in members for s in pipelines[p]})
        _say(console, f"  island {i}: pipeline{'s' if len(members) > 1 else ''} {', '.join(map(str, members))} "
                      f"({len(nodes)} node{'s' if len(nodes) > 1 else ''}, {m} micro-batch{'es' if m != 1 else ''} a step)")
    o = plan.outer
    why = {"planned": "the smallest H whose exposed exchange is <= 5% of H steps",
           "capped": "train.steps: the islands meet at least once in the run, though an exposed exchange of <= 5% "
                     "needs more steps between",
           "pinned": "as given: train.outer.every or --outer-every",
           "default": "the default: nothing was measured to choose it"}[o.every_source]
    line = (f"  outer step every {o.every} steps ({why}): Nesterov lr {o.lr:g}, momentum {o.momentum:g}, "
            f"{o.codec} deltas" + (f", {o.fragments} fragments in turn" if o.fragments > 1 else "")
            + (f", applied {o.delay} step(s) late (alpha {o.alpha:g})" if o.delay else ""))
    if o.exchange_s is not None:
        line += (f"; one exchange {o.exchange_s * 1e3:,.0f} ms ({o.exposed_s * 1e3:,.0f} ms exposed), "
                 f"{format_bytes(o.wire_bytes / o.every)} between islands a step")
    _say(console, line)


def planner_result_dict(result) -> dict:
    return {
        "step_s": result.step_s, "tokens_per_s": result.tokens_per_s, "method": result.method,
        "schedule": result.schedule, "schedule_choice": result.schedule_choice,
        "planning_s": result.planning_s, "excluded": result.excluded, "micro_batch_size": result.micro_batch_size,
        "contention": result.contention,  # host -> compute stretch priced (launcher/planning/contention.py)
        "sync_pricing": result.sync_pricing,
        "batch": None if result.batch is None else {
            "global_batch": result.batch.micro_batch_size * result.batch.num_microbatches,
            "num_microbatches": result.batch.num_microbatches, "tried_sizes": list(result.batch.tried_sizes),
            "measured_sizes": list(result.batch.measured_sizes), "per_token_error": result.batch.per_token_error},
        "pipelines": [{
            "num_microbatches": p.cost.num_microbatches, "step_s": p.cost.step_s, "bottleneck": p.cost.bottleneck,
            "stages": [{"node": s.node, "region": region, "layers": [s.layer_start, s.layer_end],
                        "compute_s": s.compute_s, "codec": s.codec, "link_s": s.link_s,
                        "link_uncompressed_s": s.link_uncompressed_s, "latency_s": s.latency_s, "window": s.window,
                        # what the step's simulation charges this stage, so anyone can simulate it again
                        "forward_s": s.forward_s, "backward_s": s.backward_s, "optimizer_s": s.optimizer_s,
                        "input_grad_s": s.input_grad_s, "weight_grad_s": s.weight_grad_s,
                        "memory_bytes": s.memory_bytes, "capacity_bytes": s.capacity_bytes}
                       for s, region in zip(p.cost.stages, p.regions)]}
            for p in result.pipelines],
        "sync": [{"layers": [g.layer_start, g.layer_end], "nodes": list(g.nodes), "bytes": g.bytes, "codec": g.codec,
                  "allreduce_s": g.allreduce_s, "end_s": g.end_s, "exposed_s": g.exposed_s,
                  "hierarchical": g.hierarchical} for g in result.sync],
    }


def print_planner_result(console: Console, profile, result, as_json: bool = False) -> None:
    """`hetlaunch plan`: one table per pipeline, or the same as JSON."""
    if as_json:
        import json

        console.print_json(json.dumps(planner_result_dict(result)))
        return
    for k, p in enumerate(result.pipelines):
        table = _table(f"pipeline {k}: {p.cost.num_microbatches} micro-batches of {result.micro_batch_size}, "
                       f"{p.cost.step_s * 1e3:.1f} ms/step",
                       ("stage", "node", "region", "layers", "ms/mb", "codec", "link ms (raw)", "memory used/free"))
        for i, (s, region) in enumerate(zip(p.cost.stages, p.regions)):
            last = i == len(p.cost.stages) - 1
            _row(table, str(i), s.node, region, f"{s.layer_start}–{s.layer_end - 1}", _ms(s.compute_s),
                 "-" if last else s.codec, "-" if last else _link(s.link_s, s.link_uncompressed_s),
                 _memory(s.memory_bytes, s.capacity_bytes))
        console.print(table)
        _say(console, f"bottleneck: {p.cost.bottleneck}")
    for g in result.sync:
        _say(console, f"gradient sync layers {g.layer_start}–{g.layer_end - 1}: {' + '.join(g.nodes)} "
                      f"({g.codec}{', by region' if g.hierarchical else ''}, {_ms(g.allreduce_s)} ms, "
                      f"{_ms(g.exposed_s)} ms not hidden by backward)")
    _say(console, f"predicted: {result.step_s * 1e3:.1f} ms/step, {result.tokens_per_s:,.0f} tokens/s "
                  f"({result.method} search, planned in {result.planning_s:.2f}s)")
    _say(console, f"schedule: {result.schedule}" + (f" ({result.schedule_choice})" if result.schedule_choice else ""))
    if result.sync_pricing:
        _say(console, f"priced: {result.sync_pricing}")
    if result.batch is not None:
        _say(console, describe(result.batch))
    _excluded(console, result.excluded)
