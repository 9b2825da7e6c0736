"""A live cluster: the coordinator, the data-plane store, the local agents, every node joined.

`hetlaunch up`, `plan` and `profile` all start one with `with ClusterSession(...) as s:`;
leaving the block (normally, on error, on Ctrl-C or SIGTERM) tells every agent to shut
down and stops every local agent process, so nothing outlives the command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from rich.console import Console

from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.coordinator import CoordinatorServer
from hetlaunch.launcher.discovery import Discovery, discovered_node
from hetlaunch.launcher.job_errors import JobError
from hetlaunch.launcher.providers.base import LaunchContext, Providers
from hetlaunch.launcher.providers.registry import providers_for
from hetlaunch.launcher.run_record import make_run_dir, write_run_file
from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.sealing import REFUSED, generation_keys

RENDEZVOUS_TIMEOUT_S = 120.0
BLAME_GRACE_S = 3.0  # how long a failure waits for its cause (a lost node) to show before it is reported
# What a stage reports when the other end of a data-plane link went away (gloo, NCCL, c10d store).
# A peer's connection broke; with timeouts and the rest, what a failed peer's neighbours see.
BROKEN_CONNECTION = ("connection closed by peer", "connection reset", "broken pipe", "remote process exited",
                     "connection refused")
PEER_ERRORS = (*BROKEN_CONNECTION, "timed out", "timeout", "socket", "nccl communicator was aborted")


def lost_message(lost: dict[str, str]) -> str:
    """One line naming every lost node (node -> why): the first line named only the first, so a
    user saw one node go where two had."""
    (first, why), *others = lost.items()
    if not others:
        return f"lost node {first}: {why}"
    return f"lost nodes {', '.join(lost)}: " + "; ".join(f"{node}: {why}" for node, why in lost.items())


class ClusterSession:
    def __init__(self, cluster, run_dir: Path, token: str, console: Console):
        self.cluster = cluster
        self.run_dir = run_dir
        self.token = token
        self.console = console
        self.nodes = {n.name: n for n in cluster.nodes}
        self.from_cache: set[str] = set()  # nodes whose layer timings the last measurement took from the cache
        self.agents = Providers(providers_for(cluster.nodes))  # every node's but launch: remote's
        self.server: CoordinatorServer | None = None
        self.lost: dict[str, str] = {}  # nodes declared lost, with why; never used again unless they rejoin
        # data_plane.encrypt: key pairs per generation, sent to the stages only on the control plane
        self.data_plane_sealed = cluster.data_plane.encrypt != "off"
        self._generation_keys: tuple = ((None, 0), None)  # (generation, world size), its ranks' key pairs

    def __enter__(self) -> "ClusterSession":
        coord = self.cluster.coordinator
        self.agents.preflight()  # a tool this machine lacks: one line, and nothing left behind
        make_run_dir(self.run_dir)  # a one-line JobError naming the path and the reason, before anything starts
        try:
            try:
                self.server = CoordinatorServer(coord.host, coord.port, self.token, list(self.nodes),
                                                heartbeat_interval_ms=round(coord.heartbeat_interval_s * 1000),
                                                credentials=self._server_credentials(),
                                                discovery=self._discovery()).start()
            except (RuntimeError, OSError) as err:  # grpc raises RuntimeError("Failed to bind ...")
                raise JobError(f"cannot listen on {coord.host}:{coord.port} (coordinator.host/port): "
                               f"{' '.join(str(err).split())[:200]}") from None
            self._write_contact()
            self.agents.start(LaunchContext(self.cluster, self.server.address, self.server.port, self.token,
                                            self.run_dir / "logs", self._agent_tls_args() + self._agent_policy_args(),
                                            self.console))
            self._wait_for_nodes()
            self._take_discovered()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _discovery(self) -> Discovery | None:
        rule = self.cluster.discover
        if rule is None:
            return None
        limit = rule.max_nodes
        layers = self.cluster.model.num_stage_layers
        if layers is not None:  # every node needs a layer: never take more than the model can use
            room = max(layers - len(self.cluster.nodes), 0)
            limit = room if limit is None else min(limit, room)
        return Discovery(rule, limit)

    def _take_discovered(self) -> None:
        """Close discovery; the agents it took become nodes of the cluster from now on."""
        discovery = self.state.discovery
        if discovery is None:
            return
        found = [discovered_node(self.state.agent_info(name)) for name in discovery.close()]
        try:
            self.cluster = self.cluster.with_discovered(found)
        except ConfigError as err:
            raise JobError(f"the discovered nodes do not fit the job: {err}") from None
        self.nodes = {n.name: n for n in self.cluster.nodes}
        self.console.print(f"discovered {len(found)} node(s): " +
                           ", ".join(f"{n.name} ({n.region}{', ' + n.host if n.host else ''})" for n in found))

    def _server_credentials(self):
        tls = self.cluster.coordinator.tls
        if tls is None:
            return None
        from hetlaunch.runtime.tls import TlsError, server_credentials

        try:
            return server_credentials(tls.cert, tls.key, tls.ca)
        except TlsError as err:
            raise JobError(str(err)) from None

    @property
    def checkpoint_root(self) -> Path:
        configured = self.cluster.checkpoint.dir
        return Path(configured).resolve() if configured else (self.run_dir / "checkpoints").resolve()

    def _agent_policy_args(self) -> list[str]:
        """The agents `up` starts here run the user's own YAML: allow exactly its entrypoint, its
        data file and its checkpoint directory (runtime/policy.py)."""
        args = [f"--checkpoint-root={self.checkpoint_root}"]
        if self.cluster.model.entrypoint:
            args.append(f"--allow-entrypoint={self.cluster.model.entrypoint}")
        if self.cluster.data.path:
            args.append(f"--data-root={Path(self.cluster.data.path).resolve()}")
        return args

    def _agent_tls_args(self) -> list[str]:
        """What local agents need to verify the coordinator (its CA, else its own certificate) and,
        under mutual TLS, to present themselves."""
        tls = self.cluster.coordinator.tls
        if tls is None:  # clear text, to a coordinator off loopback only as the YAML acknowledged
            return ["--insecure"] if self.cluster.coordinator.insecure else []
        # Absolute, as the data and checkpoint paths beside them: an agent started over ssh, by
        # Slurm or Ray runs in another directory (its home), where a relative path names nothing.
        args = ["--ca", _absolute(tls.ca or tls.cert)]
        if tls.agent_cert is not None:
            args += ["--cert", _absolute(tls.agent_cert), "--key", _absolute(tls.agent_key)]
        return args

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.state.shutdown_all("hetlaunch is done")
            self.agents.wait(5.0)
        self.agents.stop()
        if self.server is not None:
            self.server.stop()

    @property
    def state(self):
        return self.server.state

    def begin_generation(self) -> int:
        """A new generation (a data-plane group: the link probes, each plan): commands sent from
        now on carry it, and reports of earlier generations are dropped."""
        return self.state.begin_generation()

    def rendezvous(self, rank: int, world_size: int, backend: str, node: str) -> pb.Rendezvous:
        """The current generation's data-plane group (its number is the group's key prefix on the
        store), and where this node's tensors may cross (data_plane)."""
        data_plane = self.cluster.data_plane_of(self.nodes[node])
        low, high = data_plane.port_range or (0, 0)
        return pb.Rendezvous(generation=self.state.generation, rank=rank, world_size=world_size,
                             timeout_s=RENDEZVOUS_TIMEOUT_S, backend=backend, interface=data_plane.interface or "",
                             port_low=low, port_high=high, data_plane_encrypt=self.cluster.data_plane.encrypt,
                             **self._data_plane_keys(rank, world_size))

    def _data_plane_keys(self, rank: int, world_size: int) -> dict:
        """This rank's X25519 private key for the generation and every rank's public key
        (runtime/sealing.py), made once per generation; none where nothing is sealed."""
        if not self.data_plane_sealed:
            return {}
        (generation, size), keys = self._generation_keys
        if generation != self.state.generation:
            (generation, size), keys = self._generation_keys = ((self.state.generation, world_size),
                                                                generation_keys(world_size))
        if world_size != size or not 0 <= rank < size:  # new keys now would leave the ranks sent already apart
            raise ValueError(f"rank {rank} of {world_size} in generation {generation}, whose keys are for {size} ranks")
        private, public = keys
        return {"data_plane_private_key": private[rank], "data_plane_public_keys": public}

    def device_of(self, name: str) -> str:
        node = self.nodes[name]
        if node.device != "auto":
            return node.device
        info = self.state.agent_info(name)
        return "cuda" if any(d.kind == pb.DEVICE_KIND_CUDA for d in info.devices) else "cpu"

    def backend_for(self, names: list[str]) -> str:
        """NCCL only where every rank of the group computes on a GPU of its own: NCCL refuses two
        ranks on one GPU ("invalid usage"), so nodes that share one (several agents on a host's
        single GPU) exchange through host memory with gloo."""
        if not all(self.device_of(n).startswith("cuda") for n in names):
            return "gloo"
        gpus = [self.gpu_of(n) for n in names]
        return "nccl" if len(set(gpus)) == len(gpus) else "gloo"

    def gpu_of(self, name: str) -> tuple[str, ...]:
        """Which GPU a CUDA node computes on: its UUID where the agent reported one, else its
        host and device index ("cuda" alone is index 0, as torch takes it)."""
        device = self.device_of(name)
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        info = self.state.agent_info(name)
        for gpu in info.devices:
            if gpu.kind == pb.DEVICE_KIND_CUDA and gpu.index == index and gpu.uuid:
                return ("uuid", gpu.uuid)
        return ("host", info.hostname, str(index))

    def threads_of(self, name: str) -> int:
        node = self.nodes[name]
        return self.cluster.threads_for(node, os.cpu_count() or 1) if node.launch == "local" else 0

    def declare_lost(self, node: str, why: str) -> None:
        """Take a node out of the job: its agent is refused from now on (a local one is stopped,
        with its worker), and its name may join again."""
        self.lost[node] = why
        self.state.mark_lost(node)
        self.agents.kill(node)

    def rejoined(self, node: str) -> None:
        self.lost.pop(node, None)

    def lost_nodes(self, done: set[str]) -> dict[str, str]:
        """Nodes not in `done` that are gone, with how we know: a local agent process that exited,
        a command stream that broke (the agent's process or host went away), or heartbeats that
        stopped for longer than the timeout."""
        lost = {}
        done = done | set(self.lost)
        for node, code in self.agents.exited().items():
            if node not in done:
                what = self.agents.what(node)
                lost[node] = (f"{what} was killed by {signal.Signals(-code).name}" if code < 0 else
                              f"{what} exited with code {code}: {self.agents.log_tail(node)}")
        timeout = self.cluster.coordinator.heartbeat_timeout_s
        for node, (silent, state, step) in self.state.silent_for().items():
            if node in done or node in lost:
                continue
            if self.state.disconnected(node):
                lost[node] = "its connection to the coordinator broke" + _last_seen(state, step)
            elif silent > timeout:
                lost[node] = f"no heartbeat for {silent:.0f}s" + _last_seen(state, step)
        return lost

    def check_alive(self, done: set[str]) -> None:
        """Raise JobError naming a lost node, if any (used where a loss cannot be recovered from)."""
        lost = self.lost_nodes(done)
        if lost:
            raise JobError(lost_message(lost))

    def blame(self, failures: dict[str, str], what: str, done: set[str], more_failures=None) -> JobError:
        """The error to end the job with when `failures` (node -> error) came in: the cause first."""
        return JobError(self.diagnose(failures, what, done, more_failures)[1])

    def diagnose(self, failures: dict[str, str], what: str, done: set[str],
                 more_failures=None) -> tuple[dict[str, str], str]:
        """The nodes at fault for `failures` (node -> error), with why, and a one-line account.

        When a node dies, its neighbours' data-plane calls fail too ("Connection closed by
        peer"), often before the dead node is noticed. So wait a moment for a lost node or for
        more failures, then name the lost node (or else the failure that is not a peer's
        connection error) and list the others as consequences. `more_failures()` returns the
        (node, error) pairs reported meanwhile (default: failed stage results)."""
        deadline = time.monotonic() + BLAME_GRACE_S
        lost = self.lost_nodes(done | set(failures))
        more_failures = more_failures or self._stage_failures
        # A failure that is not a peer's connection error is a cause itself: no need to wait.
        while not lost and time.monotonic() < deadline and all(map(is_peer_error, failures.values())):
            time.sleep(0.1)
            failures.update(more_failures())
            lost = self.lost_nodes(done | set(failures))
        if lost:
            message = lost_message(lost)
        else:
            cause = next((n for n, e in failures.items() if not is_peer_error(e)), next(iter(failures)))
            message = f"{what} on node {cause} failed: {failures[cause]}"
            lost = {cause: f"its {what} failed: {first_line(failures[cause])}"}
        return lost, message + consequences(failures, lost)

    def _stage_failures(self) -> list[tuple[str, str]]:
        return [(node, result.error) for node, result in self.state.results() if not result.ok]

    def _write_contact(self) -> None:
        """Where remote agents (and tests) find the coordinator; the token file only when someone needs it."""
        address = self.server.address
        contact = {"address": address, "pid": os.getpid()}
        tls = self.cluster.coordinator.tls
        if tls is not None:  # how `hetlaunch status/down` reach it (paths, no secrets)
            contact["tls"] = {"ca": str(Path(tls.ca or tls.cert).resolve()),
                              **({"cert": str(Path(tls.agent_cert).resolve()), "key": str(Path(tls.agent_key).resolve())}
                                 if tls.agent_cert else {})}
        write_run_file(self.run_dir / "coordinator.json", json.dumps(contact) + "\n")  # whole or a JobError
        self.console.print(f"coordinator listening on {address} (run dir {self.run_dir})")
        token_path = self.run_dir / "token"  # for remote agents, `hetlaunch status` and `down`
        write_run_file(token_path, self.token + "\n", mode=0o600)  # never readable by others, not even briefly
        if self.cluster.remote_nodes:
            for node in self.cluster.remote_nodes:
                self.console.print(f"  on {node.host or node.name}: hetlaunch agent --coordinator "
                                   f"{self.cluster.coordinator.advertise or '<this host>'}:"
                                   f"{self.server.port} --token-file {token_path} --name {node.name}")

    def _wait_for_nodes(self) -> None:
        timeout = self.cluster.coordinator.join_timeout_s
        start = time.monotonic()
        deadline = start + timeout
        rule, discovery = self.cluster.discover, self.state.discovery
        with self.console.status("waiting for agents to join") as status:
            while True:
                missing = [n for n in self.state.missing_nodes() if n in self.nodes]
                if discovery is not None:
                    found, waited = discovery.count(), time.monotonic() - start
                    if not missing and (discovery.full() or (waited >= rule.wait_s and found >= rule.min_nodes)):
                        return
                    if waited >= rule.wait_s and found < rule.min_nodes:
                        refused = discovery.refusals()
                        raise JobError(f"discover: {found} agent(s) joined within {rule.wait_s:g}s, min_nodes is "
                                       f"{rule.min_nodes}" + (f"; refused: {refused}" if refused else ""))
                elif not missing:
                    return
                refused = self.state.refusal()
                if refused:
                    raise JobError(f"node {refused[0]} was refused: {refused[1]}")
                dead = {n: c for n, c in self.agents.exited().items() if n in missing}
                if dead:
                    node, code = next(iter(dead.items()))
                    raise JobError(f"{self.agents.what(node)} {node} exited with code {code} before joining: "
                                   f"{self.agents.log_tail(node)}")
                if missing and time.monotonic() > deadline:
                    names = ", ".join(
                        f"{n} ({self.nodes[n].launch}{', host ' + self.nodes[n].host if self.nodes[n].host else ''})"
                        for n in missing)
                    raise JobError(f"nodes never joined within {timeout:g}s: {names}")
                waiting = missing + ([f"{rule.describe()} ({discovery.count()} so far)"] if discovery else [])
                status.update(f"waiting for agents to join: {', '.join(waiting)}")
                time.sleep(0.1)


def _last_seen(state: int, step: int) -> str:
    if state == pb.AGENT_STATE_PROFILING:
        return " (it was profiling)"
    if state == pb.AGENT_STATE_TRAINING:
        return f" (it was training, last step {step})" if step >= 0 else " (it was training, before its first step)"
    return ""


def consequences(failures: dict[str, str], lost: dict[str, str]) -> str:
    """"; then failed as a consequence: ..." for the failed nodes that are not the cause. A peer's
    broken connection is said as that, not as gloo's internals ("[/__w/pytorch/.../pair.cc:537] Read
    error [127.0.0.1]:65165: Connection reset by peer. This is typicall..."); the logs keep them."""
    others = [f"{n} ({'its connection to a failed peer broke' if _broken_connection(e) else first_line(e)})"
              for n, e in failures.items() if n not in lost]
    return "; then failed as a consequence: " + ", ".join(others) if others else ""


def _broken_connection(error: str) -> bool:
    """A peer's connection broke (not a timeout, which may be a collective's own, such as NCCL's watchdog)."""
    return any(marker in error.lower() for marker in BROKEN_CONNECTION)


def is_peer_error(error: str) -> bool:
    return any(marker in error.lower() for marker in PEER_ERRORS)


_REFUSAL = re.compile(re.escape(REFUSED) + r" from node (\S+) \(rank \d+\) to node (\S+) \(rank \d+\)")


def parse_refusal(error: str) -> tuple[str, str] | None:
    """(sender, receiver) of a sealed message a stage refused (runtime/stage_command.py), else None."""
    match = _REFUSAL.search(error)
    return (match.group(1), match.group(2)) if match else None


def first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 160 else line[:157] + "..."


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())
