"""Where a run's metrics go besides metrics.jsonl: TensorBoard and a Prometheus endpoint (optional extras).

* `observe.tensorboard: true` writes scalars to runs/<id>/tensorboard/ with tensorboard's
  event file writer (the `tensorboard` extra): loss, eval loss, tokens/s, step time,
  learning rate, gradient norm, generation and restarts, and per stage the fractions of its
  step spent computing, waiting on the data plane, in gradient sync and otherwise idle,
  and the bytes it put on the wire.
* runs/<id>/trace.json, the sampled steps' timelines (launcher/timeline.py), and
  runs/<id>/calibration.json, the plan checked against the first steps (launcher/adapt/calibration.py), always.
* `coordinator.metrics_port` serves Prometheus metrics on the coordinator's host
  (prometheus-client, the `prometheus` extra): the last step, loss, tokens/s and generation,
  restarts, per node its step time, the age of its last heartbeat and the bytes it sent per
  direction, raw and on the wire.

A missing package is one line naming the extra to install, before anything starts
(launcher/extras.py, also run by `hetlaunch validate`).
"""

from __future__ import annotations

import time
from pathlib import Path

from hetlaunch.launcher.adapt.calibration import Calibration
from hetlaunch.launcher.adapt.current_plan import CurrentPlan
from hetlaunch.launcher.device_schedule_checks import several_stages_per_node
from hetlaunch.launcher.adapt.straggler import StragglerWatch
from hetlaunch.launcher.extras import check_extras
from hetlaunch.launcher.metrics_server import can_listen, serve_metrics
from hetlaunch.launcher.planning.plan import Plan
from hetlaunch.launcher.planning.profile_file import Profile
from hetlaunch.launcher.run_record import StepRecord
from hetlaunch.launcher.session import JobError
from hetlaunch.launcher.timeline import Timeline
from hetlaunch.protos import control_pb2 as pb

def metrics_port_refused(host: str, port: int, err: OSError) -> str:
    return f"coordinator.metrics_port {port}: cannot listen on {host}: {err.strerror or err}"


def check_metrics_port(cluster) -> None:
    """JobError, before any agent starts, where the metrics server could not listen."""
    host, port = cluster.coordinator.host, cluster.coordinator.metrics_port
    if port:  # null: off; 0: any free port
        try:
            can_listen(host, port)
        except OSError as err:
            raise JobError(metrics_port_refused(host, port, err)) from None


class Observers:
    """The sinks a run writes to, fed by the job driver."""

    def __init__(self, cluster, run_dir: Path, state, current: CurrentPlan):
        check_extras(cluster)
        self.state = state
        self.current = current  # the plan running, which the job driver and live moves set
        self.timeline = Timeline(run_dir)
        self.calibration = Calibration(run_dir, current, state.clock_offsets)
        self.stragglers: StragglerWatch | None = None  # set by the job driver, which can plan
        silent_for = state.silent_for
        self.tensorboard = _TensorBoard(run_dir / "tensorboard") if cluster.observe.tensorboard else None
        self.prometheus = (_Prometheus(cluster.coordinator.host, cluster.coordinator.metrics_port, silent_for)
                           if cluster.coordinator.metrics_port is not None else None)

    @property
    def metrics_address(self) -> str | None:
        return None if self.prometheus is None else self.prometheus.address

    def new_generation(self, previous: Plan | None, profile: Profile | None, first_step: int) -> None:
        """A generation starts at `first_step` with the current plan, made from `profile` (after
        `previous`): calibration compares its steps with it."""
        self.calibration.new_generation(profile, first_step)
        if self.stragglers is not None:
            self.stragglers.new_generation(previous, first_step)

    def moved(self, at_step: int) -> None:
        """A live move changed the current plan before `at_step` (calibration keeps its result,
        compared at the end with the steps before it only)."""
        self.calibration.plan_changed(at_step)
        if self.stragglers is not None:
            self.stragglers.moved(at_step)

    def trace(self, node: str, metrics: pb.StepMetrics) -> None:
        """A stage's timeline of a sampled step, on the coordinator's clock."""
        self.timeline.add(node, metrics, self.current.plan, self.state.clock_offsets())

    def step(self, record: StepRecord, generation: int) -> tuple[str, dict] | None:
        """Feed a step to calibration, the straggler watch and the sinks; an event to write
        (a straggler, a change checked), else None."""
        event = None
        plan = self.current.plan
        # Calibration and the straggler watch compare a node's one stage with its prediction; a node
        # running several stages reports them as one (launcher/device_schedule_checks.py): not fed.
        if plan is None or not several_stages_per_node(plan.schedule):
            calibrated = self.calibration.add(record)
            if self.stragglers is not None:
                if calibrated is not None and "error" not in calibrated:
                    self.stragglers.calibrated(self.calibration.profile, calibrated["node_speed_factors"])
                else:
                    event = self.stragglers.add(record)
        for sink in (self.tensorboard, self.prometheus):
            if sink is not None:
                sink.step(record, generation)
        return event

    def restarted(self, restarts: int) -> None:
        for sink in (self.tensorboard, self.prometheus):
            if sink is not None:
                sink.restarted(restarts)

    def close(self) -> None:
        for sink in (self.tensorboard, self.prometheus):
            if sink is not None:
                sink.close()


def _fractions(stage: dict) -> dict[str, float]:
    """A stage's step split into compute, waiting on the data plane, gradient sync and the rest."""
    total = stage["step_s"] or 1.0
    parts = {"compute": stage["compute_s"], "wait": stage["comm_s"], "sync": stage["sync_s"]}
    parts["idle"] = max(0.0, total - sum(parts.values()))
    return {k: v / total for k, v in parts.items()}


class _TensorBoard:
    def __init__(self, directory: Path):
        # tensorboard's own writer, the one torch.utils.tensorboard writes through (the same event
        # files): torch's SummaryWriter would load torch into the coordinator.
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.writer = EventFileWriter(str(directory))
        self.event, self.summary = Event, Summary
        self.last_step = 0

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar as torch.utils.tensorboard's add_scalar writes it (a `simple_value`)."""
        summary = self.summary(value=[self.summary.Value(tag=tag, simple_value=float(value))])
        self.writer.add_event(self.event(wall_time=time.time(), step=step, summary=summary))

    def step(self, record: StepRecord, generation: int) -> None:
        s = record.step
        self.last_step = s
        for tag, value in (("loss/train", record.loss), ("loss/eval", record.eval_loss),
                           ("throughput/tokens_per_s", record.tokens_per_s), ("throughput/step_s", record.step_s),
                           ("optimizer/lr", record.lr), ("optimizer/grad_norm", record.grad_norm),
                           ("run/generation", generation)):
            if value is not None and value == value:  # NaN (a diverged loss) is left out
                self.add_scalar(tag, value, s)
        if record.islands:
            for i, loss in enumerate(record.islands["losses"]):
                if loss is not None:
                    self.add_scalar(f"island_loss/island{i}", loss, s)
            outer = record.islands["outer"]
            if outer["launched"]:
                self.add_scalar("outer/wire_bytes", outer["bytes"][1], s)
            if outer["applied"]:
                self.add_scalar("outer/blocked_s", outer["blocked_s"], s)
        for stage in record.stages:
            name = f"p{stage['pipeline']}s{stage['stage']}_{stage['node']}"
            for part, fraction in _fractions(stage).items():
                self.add_scalar(f"stage_{part}_fraction/{name}", fraction, s)
            for direction, (raw, wire) in stage["sent_bytes"].items():
                if raw:
                    self.add_scalar(f"wire_bytes_{direction}/{name}", wire, s)

    def restarted(self, restarts: int) -> None:
        self.add_scalar("run/restarts", restarts, self.last_step)

    def close(self) -> None:
        self.writer.close()


class _Prometheus:
    def __init__(self, host: str, port: int, silent_for):
        from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
        from prometheus_client.core import GaugeMetricFamily

        self.registry = registry = CollectorRegistry()
        self.step_gauge = Gauge("hetlaunch_step", "last step every stage reported", registry=registry)
        self.loss = Gauge("hetlaunch_loss", "training loss of the last step", registry=registry)
        self.tokens = Gauge("hetlaunch_tokens_per_second", "tokens/s of the last step", registry=registry)
        self.generation = Gauge("hetlaunch_generation", "plan generation (restarts and re-plans start one)",
                                registry=registry)
        self.restarts = Gauge("hetlaunch_restarts", "generations restarted after lost nodes", registry=registry)
        self.step_s = Gauge("hetlaunch_node_step_seconds", "a node's stage's last step time", ["node"],
                            registry=registry)
        self.sent = Counter("hetlaunch_node_sent_bytes", "bytes a node's stage sent", ["node", "direction", "form"],
                            registry=registry)

        class Heartbeats:
            def collect(self):
                family = GaugeMetricFamily("hetlaunch_heartbeat_age_seconds", "seconds since a node was last heard from",
                                           labels=["node"])
                for node, (silent, _, _) in sorted(silent_for().items()):
                    family.add_metric([node], silent)
                yield family

        registry.register(Heartbeats())
        try:
            self.server, self.thread = serve_metrics(host, port, make_wsgi_app(registry))
        except OSError as err:
            raise JobError(metrics_port_refused(host, port, err)) from None
        self.address = f"{host}:{self.server.server_port}"

    def step(self, record: StepRecord, generation: int) -> None:
        self.step_gauge.set(record.step)
        if record.loss == record.loss:
            self.loss.set(record.loss)
        self.tokens.set(record.tokens_per_s)
        self.generation.set(generation)
        for stage in record.stages:
            self.step_s.labels(stage["node"]).set(stage["step_s"])
            for direction, (raw, wire) in stage["sent_bytes"].items():
                self.sent.labels(stage["node"], direction, "raw").inc(raw)
                self.sent.labels(stage["node"], direction, "wire").inc(wire)

    def restarted(self, restarts: int) -> None:
        self.restarts.set(restarts)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
