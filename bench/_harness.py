"""Shared pieces of the benchmarks: subprocess runs, steady-state figures, progress, machine facts.

Every side of every comparison runs in a fresh subprocess with one intra-op thread,
so both sides start from the same conditions; sides are alternated A, B, A, B so the
noise of a shared machine falls on both, and a run that shared the machine with other
work is repeated (see OtherLoad). A run's throughput is its tokens per step divided by
the median step time after the warm-up steps; a side's figure is the median over its
runs.
"""

from __future__ import annotations

import atexit
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch


def temporary_dir(prefix: str) -> Path:
    """A fresh folder under the system's temp, removed when the benchmark's process ends (runs,
    traces and checkpoints of a full bench run filled /tmp with 8 GB before)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent


class Reporter(Protocol):
    """What a benchmark tells the runner while it works (the runner draws it with rich)."""

    def total(self, runs: int) -> None: ...

    def total_more(self, runs: int) -> None: ...

    def advance(self, label: str) -> None: ...


class NullReporter:
    def total(self, runs: int) -> None:
        pass

    def total_more(self, runs: int) -> None:
        pass

    def advance(self, label: str) -> None:
        pass


class BenchError(RuntimeError):
    """A side of a benchmark could not run; the message says which and why."""


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine()}


def single_thread_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def start_process(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start one process of a side in a session of its own.

    hetlaunch starts each local agent in its own session, and Linux (with autogroup, the
    default) shares the CPU fairly between sessions, not processes: two agents in two
    sessions would get two shares against other work where two workers in one session get
    one. So every process of every side gets its own session.
    """
    return subprocess.Popen(cmd, env=single_thread_env(), cwd=REPO, stdin=subprocess.DEVNULL,
                            start_new_session=True, **kwargs)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM (hetlaunch up then stops its agents), SIGKILL after the grace period."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_process(cmd: list[str], what: str, timeout_s: float) -> str:
    """Run one side to the end; return its output. A non-zero exit or a timeout is a
    BenchError naming the side and the tail of its output."""
    proc = start_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what} did not finish within {timeout_s:.0f}s") from None
    finally:
        stop_process(proc)  # only a timeout or an interrupt leaves it running
    if proc.returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-8:])
        raise BenchError(f"{what} exited with code {proc.returncode}: {tail}")
    return output


def run_worker_ranks(script: str, config: dict, ranks: int, timeout_s: float, what: str) -> list[dict]:
    """Run bench/<script> as `ranks` processes (argv: CONFIG_JSON RANK STORE_PORT OUT_JSON) on a
    TCPStore this process hosts; each rank's JSON result, in rank order. BenchError names the rank."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    with tempfile.TemporaryDirectory(prefix="hetlaunch-bench-") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(ranks)]
        logs = [open(Path(tmp) / f"rank{r}.log", "w") for r in range(ranks)]
        procs = [start_process([sys.executable, str(BENCH_DIR / script), json.dumps(config), str(r), str(store.port),
                                str(outs[r])], stdout=logs[r], stderr=subprocess.STDOUT) for r in range(ranks)]
        try:
            deadline = time.monotonic() + timeout_s
            for r, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    raise BenchError(f"{what} rank {r} did not finish within {timeout_s}s") from None
                if code != 0:
                    logs[r].flush()
                    tail = " | ".join((Path(tmp) / f"rank{r}.log").read_text().strip().splitlines()[-8:])
                    raise BenchError(f"{what} rank {r} exited with code {code}: {tail}")
        finally:
            for proc in procs:  # only a failure or an interrupt leaves one running
                stop_process(proc, grace_s=2.0)
            for log in logs:
                log.close()
            del store
        return [json.loads(out.read_text()) for out in outs]


def hetlaunch_up(cluster_yaml: str, timeout_s: float) -> list[dict]:
    """`hetlaunch up` on a temporary cluster file in a subprocess; return metrics.jsonl's records."""
    with tempfile.TemporaryDirectory(prefix="hetlaunch-bench-") as tmp:
        yaml_path = Path(tmp) / "cluster.yaml"
        yaml_path.write_text(cluster_yaml)
        run_dir = Path(tmp) / "run"
        run_process([sys.executable, "-m", "hetlaunch.launcher.cli", "up", str(yaml_path), "--run-dir", str(run_dir)],
                    "hetlaunch up", timeout_s)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        summary = json.loads((run_dir / "summary.json").read_text())
    recorded = summary.get("recorded_steps", summary.get("steps"))  # steps taken, less those never reported
    if recorded != len(records):
        raise BenchError(f"hetlaunch up wrote {len(records)} metric lines but summary.json says {recorded}")
    return records


def steady(step_s: list[float], warmup: int) -> list[float]:
    if len(step_s) <= warmup:
        raise BenchError(f"only {len(step_s)} steps; need more than the {warmup} warm-up steps")
    return step_s[warmup:]


def run_tokens_per_s(tokens_per_step: int, step_s: list[float], warmup: int) -> float:
    """Steady-state throughput of one run: tokens per step over the median step time after warm-up."""
    return tokens_per_step / statistics.median(steady(step_s, warmup))


# ---------------------------------------------------------------- other work on the machine
#
# Wall-clock throughput on a shared 2-core machine is only as good as the quiet it was
# measured in. Each run measures how many cores *other* processes kept busy meanwhile:
# the machine's busy time (/proc/stat) minus this process tree's CPU time (getrusage of
# this process and its waited-for children, which includes every agent or worker a run
# starts). A run that shared the machine with more than NOISY_CORES of other work is
# repeated while the benchmark's retry budget lasts; medians use the clean runs.

NOISY_CORES = 0.2
MAX_ATTEMPTS = 3  # per run, so one long busy spell cannot spend the whole retry budget
MAX_WAIT_S = 15.0  # per attempt, waiting for a quiet moment before starting


def _machine_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None  # not Linux: no accounting, every run counts as clean
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _our_cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """Cores that processes other than ours kept busy, on average, since construction."""

    def __init__(self):
        self.t0, self.busy0, self.ours0 = time.monotonic(), _machine_busy_s(), _our_cpu_s()

    def cores(self) -> float | None:
        busy = _machine_busy_s()
        if busy is None or self.busy0 is None:
            return None
        elapsed = time.monotonic() - self.t0
        return max(0.0, (busy - self.busy0) - (_our_cpu_s() - self.ours0)) / max(elapsed, 1e-3)


def wait_for_quiet(max_wait_s: float, sample_s: float = 1.0) -> float:
    """Wait (at most max_wait_s) until other work uses under NOISY_CORES for one sample; return seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        load = OtherLoad()
        time.sleep(sample_s)
        cores = load.cores()
        if cores is None or cores < NOISY_CORES:
            break
    return time.monotonic() - start


# ---------------------------------------------------------------- alternating the sides


@dataclass
class Side:
    """One side of a comparison: a label and a function that does one run and returns its raw record.

    The record must hold "step_s" (per step, as the slowest stage sees it) and may hold "loss".
    """

    key: str
    label: str
    run_once: Callable[[], dict]


def alternate(a: Side, b: Side, reps: int, reporter: Reporter, retry_budget_s: float) -> dict:
    """Run A, B, A, B, ... `reps` times each (`rotate` of two sides)."""
    return rotate([a, b], reps, reporter, retry_budget_s)


def rotate(sides: list[Side], reps: int, reporter: Reporter, retry_budget_s: float) -> dict:
    """Run A, B, C, A, B, C, ... `reps` times each.

    Before each run, wait (up to MAX_WAIT_S) for the machine to be quiet; a run during which
    other work kept more than NOISY_CORES busy is repeated (up to MAX_ATTEMPTS), while
    `retry_budget_s` (waiting plus repeated runs) lasts. Returns {"runs": per side, the kept
    record of each run (marked "clean" or not), "discarded": per side, what the repeated
    runs measured, "retry_budget_s_used"}.
    """
    runs: dict[str, list[dict]] = {side.key: [] for side in sides}
    discarded: dict[str, list[dict]] = {side.key: [] for side in sides}
    spent = 0.0
    for rep in range(reps):
        for side in sides:
            attempt = 0
            while True:
                attempt += 1
                reporter.advance(f"{side.label} (run {rep + 1}/{reps}"
                                 + (f", attempt {attempt}: the last one shared the machine)" if attempt > 1 else ")"))
                waited = wait_for_quiet(max(0.0, min(MAX_WAIT_S, retry_budget_s - spent)))
                spent += waited
                load = OtherLoad()
                started = time.monotonic()
                record = side.run_once()
                other = load.cores()
                record.update(other_cores=None if other is None else round(other, 3), waited_s=round(waited, 1),
                              attempt=attempt, clean=other is None or other <= NOISY_CORES)
                if record["clean"] or attempt >= MAX_ATTEMPTS or spent >= retry_budget_s:
                    break
                spent += time.monotonic() - started
                discarded[side.key].append({k: record[k] for k in ("other_cores", "attempt", "step_s")})
                reporter.total_more(1)
            runs[side.key].append(record)
    reporter.advance("done")
    return {"runs": runs, "discarded": discarded, "retry_budget_s": retry_budget_s,
            "retry_budget_s_used": round(spent, 1)}


def compare(measured: dict, a: str, b: str, tokens_per_step: int, warmup: int, target: float) -> dict:
    """Medians of per-run steady throughput on each side (clean runs, when each side has at
    least two), their ratio a/b, and the ratio of each A/B pair run next to each other."""
    runs = measured["runs"]
    tps = {side: [run_tokens_per_s(tokens_per_step, r["step_s"], warmup) for r in runs[side]] for side in (a, b)}
    clean = {side: [t for t, r in zip(tps[side], runs[side]) if r["clean"]] for side in (a, b)}
    use_clean = all(len(clean[side]) >= 2 for side in (a, b))
    basis = clean if use_clean else tps
    median_a, median_b = statistics.median(basis[a]), statistics.median(basis[b])
    ratio = median_a / median_b
    # Cross-check that time-slicing by other work barely moves: the 10th percentile of every
    # kept steady step of a side. Not the headline (medians are), but when the two ratios
    # disagree the machine was too busy for either to be trusted.
    p10 = {side: _quantile([t for r in runs[side] for t in steady(r["step_s"], warmup)], 0.10) for side in (a, b)}
    return {
        "figure": {"name": f"{a} / {b} tokens/s", "value": ratio, "target": f">= {target}"},
        "tokens_per_s": {a: median_a, b: median_b},
        "ratio": ratio,
        "p10_step_ratio": p10[b] / p10[a],
        "target": target,
        "met": ratio >= target,
        "basis": "clean runs" if use_clean else "all runs (too few clean runs: the machine was busy)",
        "clean_runs": {side: len(clean[side]) for side in (a, b)},
        "runs_tokens_per_s": tps,
        "pair_ratios": [x / y for x, y in zip(tps[a], tps[b])],
        "clean_pair_ratios": [x / y for x, y, ra, rb in zip(tps[a], tps[b], runs[a], runs[b])
                              if ra["clean"] and rb["clean"]],
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def max_loss_gap(runs: dict[str, list[dict]], a: str, b: str) -> float | None:
    """Largest |loss_a - loss_b| over the steps of the first run of each side: both sides must train the same thing."""
    la, lb = runs[a][0].get("loss"), runs[b][0].get("loss")
    if not la or not lb:
        return None
    return max(abs(x - y) for x, y in zip(la, lb))
