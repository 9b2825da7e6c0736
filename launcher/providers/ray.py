"""Agents that `hetlaunch up` starts in a Ray cluster (launch: ray).

`up` connects to the cluster of the top-level `ray:` as a driver (`ray.init`, a namespace of its
own per run), asks for one placement group with one bundle per launch: ray node (CPUs, GPUs, a GPU
type, custom resources such as a region: launcher/ray_config.py), spread as `ray.strategy` says,
and waits for it a bounded time; a group Ray cannot place is one line naming what no Ray node has.
Then one actor per bundle (runtime/ray_agent_host.py) checks that its Ray node has hetlaunch and
torch of our versions and starts the node's agent as its subprocess.

The token: not an argument of the actor's constructor (Ray keeps those in its GCS and shows actor
definitions in its dashboard and state API), but of one method call, `start`, which Ray carries
from this driver to the actor's worker inside its own task message (pickled by Ray, between our
own two processes, in clear text unless the Ray cluster runs TLS). The actor writes it on the
agent's stdin, never on a command line. Nothing Ray returns to us carries more than exit codes,
versions and log bytes.

The lifeline: the actors are not detached and never restarted (max_restarts=0), so when `up`
ends, or dies and its driver connection with it, Ray ends them and removes the placement group;
an agent's stdin is a pipe from its actor's process, so it exits with it. A dead actor, or an
agent that exited, is a lost node: hetlaunch re-plans without it (a new actor is not started).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from hetlaunch.launcher.coordinator import host_port
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.providers.base import AgentProvider, LaunchContext
from hetlaunch.launcher.providers.ssh import advertised_host
from hetlaunch.launcher.ray_config import RayNodeConfig
from hetlaunch.runtime.ray_agent_host import MAX_CHUNK, AgentHost
from hetlaunch.runtime.version import hetlaunch_version, torch_version

ACTOR_TIMEOUT_S = 60.0  # for an actor's worker to start and answer (Ray starts Python workers on demand)
CALL_TIMEOUT_S = 10.0  # for one stop/kill call to a running actor
POLL_TIMEOUT_S = 2.0  # for exited()'s status calls: a slow answer is no verdict (heartbeats judge a hung node)
POLL_INTERVAL_S = 0.5  # exited() asks the actors at most this often (the session asks every 0.1 s)
DRIVER_LOG = "_ray-driver.log"  # in the run's logs: what Ray's core wrote while `up` connected (no node name starts with _)
ACTOR_DIED = 1  # the exit code reported for an agent whose actor died (log_tail says how)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise JobError("launch: ray needs the ray package: pip install 'hetlaunch[ray]'") from None
    return ray


class RayProvider(AgentProvider):
    launch = "ray"
    what = "agent on Ray"

    def __init__(self, nodes):
        super().__init__(nodes)
        self.ray = None
        self.placement = None
        self.actors: dict[str, object] = {}  # node -> actor handle
        self.codes: dict[str, int] = {}  # node -> its agent's exit code, once it ended
        self.died: dict[str, str] = {}  # node -> why its actor died
        self.offsets: dict[str, int] = {}  # node -> log bytes copied into runs/<id>/logs/<node>.log
        self.ctx: LaunchContext | None = None
        self.polled = 0.0

    # -- start ------------------------------------------------------------------------------------

    def start(self, ctx: LaunchContext) -> None:
        self.ctx = ctx
        ray = self.ray = _import_ray()
        config = ctx.cluster.ray
        namespace = f"hetlaunch-{ctx.log_dir.parent.name}-{uuid.uuid4().hex[:8]}"
        driver_log = ctx.logs() / DRIVER_LOG
        try:
            with ctx.console.status(f"connecting to the Ray cluster at {config.address}"), \
                    _native_stderr_into(driver_log):
                _connect(ray, config.address, config.connect_timeout_s, namespace)
        except JobError as err:
            said = driver_log.exists() and driver_log.stat().st_size > 0
            raise JobError(f"{err}{f' (what Ray said: {driver_log})' if said else ''}") from None
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [_ray_of(node).bundle() for node in self.nodes]
        self.placement = placement_group(bundles, strategy=config.strategy, name=namespace)
        with ctx.console.status(f"waiting for Ray to place {len(bundles)} agent(s) ({config.strategy})"):
            try:
                ray.get(self.placement.ready(), timeout=config.placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise JobError(f"Ray did not place the agents of {', '.join(n.name for n in self.nodes)} within "
                               f"{config.placement_timeout_s:g}s (ray.placement_timeout_s): "
                               f"{self._why_unplaced(bundles, config.strategy)}") from None
        host_class = ray.remote(AgentHost)
        for i, (node, bundle) in enumerate(zip(self.nodes, bundles)):
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
            self.actors[node.name] = host_class.options(
                name=f"agent-{node.name}", num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom,
                max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
            ).remote(node.name)
        self._check_versions()
        coord = ctx.cluster.coordinator
        address = host_port(advertised_host(coord.host, coord.advertise), ctx.port)
        starts = {name: actor.start.remote(["--coordinator", address, f"--name={name}", "--connect-timeout", "30",
                                            *ctx.agent_args], ctx.token, max(int(_ray_of(self._node(name)).num_cpus), 1))
                  for name, actor in self.actors.items()}  # the token: a method argument, never the constructor's
        self._answers(starts, ACTOR_TIMEOUT_S, "start its agent")
        ctx.console.print(f"started {len(self.actors)} agent(s) on Ray ({config.address}, namespace {namespace}), "
                          f"dialing {address}")

    def _check_versions(self) -> None:
        answers = self._answers({n: a.versions.remote() for n, a in self.actors.items()}, ACTOR_TIMEOUT_S,
                                "report its versions")
        ours = {"hetlaunch": hetlaunch_version(), "torch": torch_version()}
        for name, theirs in answers.items():
            if {k: theirs.get(k) for k in ours} != ours:
                raise JobError(f"node {name} (Ray node {theirs.get('host', '?')}): it has hetlaunch "
                               f"{theirs.get('hetlaunch', '?')}, torch {theirs.get('torch', '?')}; this machine has "
                               f"hetlaunch {ours['hetlaunch']}, torch {ours['torch']}; install the same there")

    def _answers(self, refs: dict[str, object], timeout_s: float, doing: str) -> dict[str, object]:
        """Every node's answer, or JobError naming the first actor that died or did not answer."""
        ray = self.ray
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        answers = {}
        for name, ref in refs.items():
            if ref not in ready:
                raise JobError(f"node {name}: its Ray actor did not {doing} within {timeout_s:g}s "
                               f"(is a Python worker able to start on that Ray node?)")
            try:
                answers[name] = ray.get(ref)
            except ray.exceptions.RayError as err:
                reason = _ray_reason(err)
                hint = ("; install this hetlaunch on the Ray nodes, in the Python their workers run"
                        if "No module named 'hetlaunch" in reason else "")
                raise JobError(f"node {name}: its Ray actor failed to {doing}: {reason}{hint}") from None
        return answers

    def _why_unplaced(self, bundles: list[dict[str, float]], strategy: str) -> str:
        """Why no placement: a resource no Ray node has, a bundle no one node fits, too few nodes."""
        try:
            alive = [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]
        except Exception as err:  # noqa: BLE001 - the reason is a nicety; the timeout is the error
            return f"could not ask Ray why ({_first_line(str(err))})"
        for node, bundle in zip(self.nodes, bundles):
            for key, need in bundle.items():
                if not any(key in r for r in alive):
                    return f"no Ray node has resource {key} (node {node.name} asks for {key}: {need:g})"
            if not any(all(r.get(k, 0) >= v for k, v in bundle.items()) for r in alive):
                return f"no single Ray node has all that node {node.name} asks for ({_show(bundle)})"
        if strategy == "STRICT_SPREAD" and len(alive) < len(bundles):
            return f"STRICT_SPREAD needs {len(bundles)} Ray nodes, the cluster has {len(alive)}"
        return (f"the {len(alive)} Ray node(s) have what each agent asks for, but not free now or not together "
                f"({strategy}); `ray status` shows what is taken")

    # -- watch ------------------------------------------------------------------------------------

    def exited(self) -> dict[str, int]:
        if time.monotonic() - self.polled >= POLL_INTERVAL_S:
            self._poll()
        return dict(self.codes)

    def _poll(self, timeout_s: float = POLL_TIMEOUT_S) -> None:
        """Ask every actor whose agent still runs for its exit code and new log bytes."""
        self.polled = time.monotonic()
        ray = self.ray
        refs = {name: actor.status.remote(self.offsets.get(name, 0)) for name, actor in self.actors.items()
                if name not in self.codes}
        if not refs:
            return
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        for name, ref in refs.items():
            if ref not in ready:
                continue  # a slow answer is no verdict; the heartbeat timeout judges a hung node
            try:
                code, chunk = ray.get(ref)
            except ray.exceptions.RayError as err:  # the actor (its worker process or its Ray node) died
                self.died[name] = _ray_reason(err)
                self.codes[name] = ACTOR_DIED
                continue
            if chunk:
                with open(os.open(self.ctx.log_path(name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
                    log.write(chunk)
                self.offsets[name] = self.offsets.get(name, 0) + len(chunk)
            if code is not None and len(chunk) < MAX_CHUNK:  # ended, and its log is all here
                self.codes[name] = code

    def log_tail(self, node: str) -> str:
        if node in self.died:
            return f"its Ray actor died: {self.died[node]}"
        try:
            lines = self.ctx.log_path(node).read_text(errors="replace").strip().splitlines()
        except (OSError, AttributeError):
            return ""
        return " | ".join(lines[-5:])

    def kill(self, node: str) -> None:
        actor = self.actors.get(node)
        if actor is None:
            return
        try:
            self.ray.get(actor.kill.remote(), timeout=CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead or hung: ending the actor ends the agent (its lifeline)
            pass
        self.ray.kill(actor, no_restart=True)
        self.codes.setdefault(node, -9)

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll(timeout_s=max(min(deadline - time.monotonic(), CALL_TIMEOUT_S), 0.01))
            if len(self.codes) == len(self.actors):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    # -- stop -------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 5.0) -> None:
        """Close each agent's lifeline (then SIGTERM, SIGKILL) in its actor, copy the last of its
        log, end the actors, remove the placement group, disconnect."""
        ray = self.ray
        if ray is None or not ray.is_initialized():
            return
        try:
            live = {n: a for n, a in self.actors.items() if n not in self.died}
            if live:
                refs = [a.stop.remote(grace_s) for a in live.values()]
                ray.wait(refs, num_returns=len(refs), timeout=3 * grace_s + CALL_TIMEOUT_S)
                self._poll(CALL_TIMEOUT_S)
                discards = [a.discard.remote() for a in live.values()]
                ray.wait(discards, num_returns=len(discards), timeout=CALL_TIMEOUT_S)
            for actor in self.actors.values():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if self.placement is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.placement)
        finally:
            ray.shutdown()

    def _node(self, name: str):
        return next(n for n in self.nodes if n.name == name)


def _ray_of(node) -> RayNodeConfig:
    return node.ray or RayNodeConfig()


@contextlib.contextmanager
def _native_stderr_into(path: Path):
    """This process's file descriptor 2 appended to `path` for the block. Ray's C++ core writes its
    failed tries to reach a head straight to it ("Failed to connect to GCS ..."), ahead of `up`'s
    one-line error, and RAY_BACKEND_LOG_LEVEL is read only after they are written. Python's
    sys.stderr goes there too meanwhile (`up`'s progress is on stdout). A try Ray makes after the
    block (it goes on retrying in its thread until `up` exits) still reaches the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 2)
        os.close(log)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _connect(ray, address: str, timeout_s: float, namespace: str) -> None:
    """ray.init as a driver, bounded: an address nobody listens on fails at once, one that never
    answers after `timeout_s` (ray.init itself would retry for minutes)."""
    if address != "auto":
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 10.0)).close()
        except OSError as err:
            raise JobError(f"ray.address {address}: cannot reach the Ray head there ({err.strerror or err})") from None
    failure: list[BaseException] = []
    # In a thread of its own: bounded, and ray.init then leaves `up`'s SIGTERM handler (which unwinds
    # and stops every agent) in place instead of putting sys.exit there; its warning saying so is noise.
    logging.getLogger("ray._private.worker").addFilter(
        lambda record: "SIGTERM handler is not set" not in record.getMessage())

    def init() -> None:
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=True)
        except BaseException as err:  # noqa: BLE001 - reported below
            failure.append(err)

    thread = threading.Thread(target=init, name="ray-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise JobError(f"ray.address {address}: no Ray cluster answered within {timeout_s:g}s (ray.connect_timeout_s)")
    if failure:
        raise JobError(f"ray.address {address}: cannot connect: {_first_line(str(failure[0]))}")


def _ray_reason(err: BaseException) -> str:
    """The line of a Ray error that says why (Ray's messages run to tracebacks)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line and ":" in line and not line.startswith("File "):
            return _first_line(line)
    return _first_line(lines[0] if lines else type(err).__name__)


def _show(bundle: dict[str, float]) -> str:
    return ", ".join(f"{k}: {v:g}" for k, v in bundle.items())


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 200 else line[:197] + "..."
