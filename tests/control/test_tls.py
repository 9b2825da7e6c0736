"""TLS on the control plane, for real: certificates made by `hetlaunch certs init`, a job whose
local agents join over mutual TLS, remote agents with the wrong certificate (or none, or the
wrong CA for the coordinator) refused, and a relay between agent and coordinator that sees the
join token in clear text without TLS and never with it."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import threading

import pytest

from conftest import error_of, hetlaunch_cmd, hetlaunch_env, popen_hetlaunch, run_hetlaunch, stop_process, wait_for

TOKEN = "tls-test-join-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    result = run_hetlaunch("certs", "init", str(directory / "ok"), timeout=60)
    assert result.returncode == 0, result.stderr
    other = run_hetlaunch("certs", "init", str(directory / "other"), timeout=60)  # a CA the cluster does not trust
    assert other.returncode == 0, other.stderr
    return directory / "ok", directory / "other"


def test_certs_init_writes_keys_private_and_refuses_a_second_ca(certs):
    ok, _ = certs
    for name in ("ca.pem", "ca.key", "coordinator.pem", "coordinator.key", "agent.pem", "agent.key"):
        assert (ok / name).read_bytes().startswith(b"-----BEGIN ")
        if name.endswith(".key"):
            assert stat.S_IMODE((ok / name).stat().st_mode) == 0o600
    again = run_hetlaunch("certs", "init", str(ok), timeout=60)
    assert again.returncode == 2 and "ca.key exists" in again.stderr


@pytest.mark.parametrize("host, message", [("bücher.example", "is not ASCII: give its ASCII form, xn--bcher-kva.example"),
                                           ("ü..x", "is not ASCII")])
def test_certs_init_refuses_a_host_name_that_is_not_ascii_in_one_line(tmp_path, host, message):
    """It ended in cryptography's traceback (a hostile review)."""
    result = run_hetlaunch("certs", "init", str(tmp_path / "c"), "--host", host, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == f"error: --host {host!r} {message}", result.stderr
    assert not (tmp_path / "c" / "ca.key").exists()


@pytest.mark.parametrize("host", ["a..b", "1.2.3.4/24", "[::1]", "-", "a" * 64 + ".example", "-x.example", "\x1b[31mred",
                                  "a b", "", "10.0.0.256", "1.2.3.4.", "*.1.2.3.4"])
def test_certs_init_refuses_what_no_client_could_dial_in_one_line(tmp_path, host):
    """Each went into the certificate as a DNS name, exit 0 (a hostile review)."""
    result = run_hetlaunch("certs", "init", str(tmp_path / "c"), "--host", host, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == f"error: --host {host!r} is not a host name or an IP address", \
        result.stderr
    assert not (tmp_path / "c").exists()


def test_certs_init_takes_names_wildcards_and_addresses(tmp_path):
    from cryptography import x509

    long_name = ".".join(["a" * 63] * 3 + ["b" * 61]) + "."  # 253 characters and the root's dot
    hosts = ["node-1.example.com", "*.pods.example", "10.0.0.7", "fd00::7", "coordinator.", "single", long_name]
    result = run_hetlaunch("certs", "init", str(tmp_path / "c"), *[a for h in hosts for a in ("--host", h)], timeout=60)
    assert result.returncode == 0, result.stderr
    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "coordinator.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    named = set(sans.get_values_for_type(x509.DNSName)) | {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    # Named without the trailing dot: OpenSSL matched `coordinator.` to no client dialing `coordinator`.
    assert {h.removesuffix(".") for h in hosts} <= named and "coordinator." not in named


def test_certs_init_never_replaces_a_key_of_an_earlier_one(tmp_path):
    """Only ca.key was looked for: a folder holding coordinator.key had it replaced silently."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "coordinator.key").write_text("the key a running coordinator uses\n")
    result = run_hetlaunch("certs", "init", str(tmp_path / "c"), timeout=60)
    assert result.returncode == 2 and "coordinator.key exists" in result.stderr, result.stderr
    assert (tmp_path / "c" / "coordinator.key").read_text() == "the key a running coordinator uses\n"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["coordinator.key"]


def test_certs_init_prints_a_folder_named_with_escape_sequences_escaped(tmp_path):
    folder = tmp_path / "c\x1b]0;pwned\x07"
    result = run_hetlaunch("certs", "init", str(folder), timeout=60)
    assert result.returncode == 0 and "\x1b" not in result.stdout and "c\\x1b]0;pwned\\x07" in result.stdout, result.stdout


def _yaml(tmp_path, certs_dir, nodes: str, tls: bool = True, steps: int = 3) -> str:
    tls_block = (f"tls: {{cert: {certs_dir}/coordinator.pem, key: {certs_dir}/coordinator.key, ca: {certs_dir}/ca.pem, "
                 f"agent_cert: {certs_dir}/agent.pem, agent_key: {certs_dir}/agent.key}}, ") if tls else ""
    path = tmp_path / "cluster.yaml"
    path.write_text(f"""name: tls
coordinator: {{{tls_block}host: 127.0.0.1, join_timeout_s: 40}}
model: {{preset: tiny, n_layers: 2, seq_len: 16, d_model: 32}}
train: {{steps: {steps}, micro_batch_size: 2, num_microbatches: 2, checkpoint_every: 0}}
nodes:
{nodes}
""")
    return str(path)


@pytest.mark.timeout(150)
def test_local_agents_train_over_mutual_tls(tmp_path, certs):
    ok, _ = certs
    nodes = "  - {name: a, device: cpu, threads: 1}\n  - {name: b, device: cpu, threads: 1}"
    result = run_hetlaunch("up", _yaml(tmp_path, ok, nodes), "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


class Relay:
    """A TCP relay on 127.0.0.1 that forwards to the coordinator and keeps every byte it saw."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.seen = bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src, dst):
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.server.close()


def _remote_job(tmp_path, certs_dir, agent_args: list[str], tls: bool = True, relay: bool = False):
    """`up` with one remote node; start its agent with `agent_args`; returns (agent, up) results and the relay."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    yaml = _yaml(tmp_path, certs_dir, "  - {name: r, launch: remote, device: cpu}", tls=tls, steps=2)
    run_dir = tmp_path / "run"
    up = popen_hetlaunch("up", yaml, "--run-dir", str(run_dir), "--token-file", str(token_file))
    tap = None
    try:
        contact = run_dir / "coordinator.json"
        address = wait_for(lambda: contact.exists() and json.loads(contact.read_text() or "{}").get("address"), 30,
                           "the coordinator's address", proc=up)
        if relay:
            tap = Relay(address)
            address = f"127.0.0.1:{tap.port}"
        agent = subprocess.run(hetlaunch_cmd("agent", "--coordinator", address, "--token-file", str(token_file),
                                             "--name", "r", "--connect-timeout", "4", *agent_args),
                               capture_output=True, text=True, timeout=120, env=hetlaunch_env(OMP_NUM_THREADS="1"))
        if agent.returncode == 0:  # the job ran: let `up` finish it
            up.wait(timeout=60)
    finally:
        up_out, up_err = stop_process(up, grace_s=10)
        if tap is not None:
            tap.close()
    return agent, up, tap


@pytest.mark.timeout(150)
@pytest.mark.parametrize("which", ["foreign_cert", "no_cert", "wrong_ca"])
def test_an_agent_with_the_wrong_certificate_never_joins(tmp_path, certs, which):
    ok, other = certs
    args = {"foreign_cert": ["--ca", f"{ok}/ca.pem", "--cert", f"{other}/agent.pem", "--key", f"{other}/agent.key"],
            "no_cert": ["--ca", f"{ok}/ca.pem"],
            "wrong_ca": ["--ca", f"{other}/ca.pem", "--cert", f"{ok}/agent.pem", "--key", f"{ok}/agent.key"]}[which]
    agent, up, _ = _remote_job(tmp_path, ok, args)
    assert agent.returncode != 0
    assert "Traceback" not in agent.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


@pytest.mark.timeout(200)
def test_a_relay_sees_the_token_without_tls_and_never_with_it(tmp_path, certs):
    ok, _ = certs
    agent, up, tap = _remote_job(tmp_path / "tls", ok,
                                 ["--ca", f"{ok}/ca.pem", "--cert", f"{ok}/agent.pem", "--key", f"{ok}/agent.key"],
                                 relay=True)
    assert agent.returncode == 0 and up.returncode == 0, agent.stderr
    assert len(tap.seen) > 1000 and TOKEN.encode() not in tap.seen
    # The same relay on a clear-text coordinator: the token crosses readable (what TLS is for).
    agent, up, tap = _remote_job(tmp_path / "clear", ok, [], tls=False, relay=True)
    assert agent.returncode == 0, agent.stderr
    assert TOKEN.encode() in tap.seen


def test_a_coordinator_on_a_public_address_needs_tls_or_says_insecure():
    assert "coordinator.host: binds 0.0.0.0 without coordinator.tls" in error_of(
        "coordinator: {host: 0.0.0.0}\nnodes: [{name: a}]")
    # A loopback address, and an explicit insecure: true, are accepted.
    from hetlaunch.launcher.cluster_yaml import parse_cluster

    parse_cluster("coordinator: {host: 0.0.0.0, insecure: true}\nnodes: [{name: a}]", "c.yaml")
    parse_cluster("coordinator: {host: '::1'}\nnodes: [{name: a}]", "c.yaml")
    assert "coordinator.tls.agent_cert" in error_of(
        "coordinator: {tls: {cert: c.pem, key: c.key, ca: ca.pem}}\nnodes: [{name: a}]")
