"""What `up` checks before it starts agents on other machines (over ssh, by Slurm or Ray): the
address they dial, the TLS files they are handed, the ssh command line, and how an agent whose
lifeline is stdin exits. Found by a hostile review of the starters (2026-12-06)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetlaunch.launcher.cluster_yaml import parse_cluster
from hetlaunch.launcher.config_types import ConfigError
from hetlaunch.launcher.node_config import NodeConfig
from hetlaunch.launcher.providers.ssh import SshError, advertised_host, ssh_command


def test_a_loopback_coordinator_address_is_refused_for_agents_on_another_machine(monkeypatch):
    with pytest.raises(SshError, match="loopback address.*coordinator.advertise"):
        advertised_host("127.0.0.1", None, ["gpu1.invalid"])
    # Agents on this machine (the tests' own sshd) may dial loopback; an advertised name is taken as given.
    assert advertised_host("127.0.0.1", None, ["127.0.0.1", "localhost"]) == "127.0.0.1"
    assert advertised_host("127.0.0.1", "head.example", ["gpu1.invalid"]) == "head.example"
    # Bound to every interface: this machine's name, never looked up here (Debian maps its own name
    # to 127.0.1.1 in /etc/hosts while other machines resolve it to the LAN address; a review found
    # a lookup refusing that working setup). Its host name only where getfqdn says `localhost`.
    import socket
    monkeypatch.setattr(socket, "getfqdn", lambda: "head.lab.example")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: pytest.fail(f"looked up {name}"))
    assert advertised_host("0.0.0.0", None, ["gpu1"]) == "head.lab.example"
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "head")
    assert advertised_host("0.0.0.0", None, ["gpu1"]) == "head"


def test_ssh_never_asks_for_a_terminal_whatever_the_node_options_say():
    node = NodeConfig(name="a", launch="ssh", host="gpu1", ssh_options=["-tt", "-o", "RequestTTY=force"])
    cmd = ssh_command(node, ["true"])
    # The last of -t/-T counts: a terminal echoes stdin's first line (the join token) into the log.
    assert cmd.index("-T") > max(i for i, word in enumerate(cmd) if word == "-tt") and cmd.index("-T") < cmd.index("--")


def _cluster(launch_line: str, tls: str) -> str:
    return f"""
model: {{preset: tiny}}
coordinator: {{host: 0.0.0.0, advertise: head.example, tls: {tls}}}
nodes:
  - {{name: a, {launch_line}}}
"""


def test_mutual_tls_needs_an_agent_certificate_for_every_kind_of_agent_up_starts(tmp_path):
    tls = "{cert: c.pem, key: k.pem, ca: ca.pem}"
    with pytest.raises(ConfigError, match="agent_cert.*launch: ssh"):
        parse_cluster(_cluster("launch: ssh, host: gpu1", tls))
    parse_cluster(_cluster("launch: remote", tls))  # the user starts those, with their own certificates


def test_the_tls_files_handed_to_started_agents_are_absolute_paths(tmp_path, monkeypatch):
    from hetlaunch.launcher.session import _absolute
    monkeypatch.chdir(tmp_path)
    assert _absolute("certs/ca.pem") == str(tmp_path / "certs" / "ca.pem")
    assert Path(_absolute("~/ca.pem")).is_absolute()


@pytest.mark.timeout(60)
def test_an_agent_whose_lifeline_is_stdin_exits_with_its_own_code_not_sigabrt():
    """The lifeline thread read sys.stdin.buffer: at exit the interpreter could not take the
    buffer's lock and aborted (exit 134, "Fatal Python error"), hiding the agent's reason."""
    agent = subprocess.Popen([sys.executable, "-m", "hetlaunch.runtime.agent", "--coordinator", "127.0.0.1:1",
                              "--name", "x", "--token-file", "-", "--stdin-lifeline", "--connect-timeout", "1"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agent.stdin.write("token\n")
    agent.stdin.flush()  # stdin stays open: the lifeline thread is blocked reading it when the agent gives up
    try:
        agent.wait(timeout=45)  # not communicate(): it closes stdin, which ends the agent by its lifeline
        out = agent.stdout.read()
    finally:
        agent.kill()
        agent.stdin.close()
    assert agent.returncode == 3, out
    assert "could not reach the coordinator" in out and "Fatal Python error" not in out, out


def test_an_agent_dials_another_machine_in_clear_text_only_when_told_to():
    """Without --ca the token goes in clear to whoever answers: refused off loopback unless
    --insecure says the network is trusted (as coordinator.insecure does on the other side)."""
    from hetlaunch.runtime.agent import tls_credentials

    with pytest.raises(ValueError, match="another machine.*--ca.*--insecure"):
        tls_credentials(None, None, None, "10.0.0.5:29400")
    with pytest.raises(ValueError, match="another machine"):
        tls_credentials(None, None, None, "[2001:db8::1]:29400")
    assert tls_credentials(None, None, None, "10.0.0.5:29400", insecure=True) is None
    assert tls_credentials(None, None, None, "127.0.0.1:29400") is None
    assert tls_credentials(None, None, None, "[::1]:29400") is None and tls_credentials(None, None, None,
                                                                                      "localhost:1") is None
    done = subprocess.run([sys.executable, "-m", "hetlaunch.launcher.cli", "agent", "--coordinator", "203.0.113.9:29400",
                           "--name", "a"], env={**os.environ, "HETLAUNCH_TOKEN": "t"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--insecure" in done.stderr, done.stderr


@pytest.mark.parametrize("options, error", [
    (["-J", "bastion", "gpu2"], "'gpu2' is not an ssh option"),  # ssh would log in to gpu2
    (["-i"], "-i needs a value"),
    (["key.pem"], "'key.pem' is not an ssh option"),
    (["--", "x"], "'--' is not an ssh option"),
])
def test_a_stray_word_in_ssh_options_is_refused_before_ssh_takes_it_for_the_host(options, error):
    with pytest.raises(ConfigError, match=error):
        parse_cluster(_ssh_node(options))


@pytest.mark.parametrize("options", [["-i", "key.pem"], ["-ikey.pem", "-v", "-o", "A=b"], ["-vvJ", "jump"],
                                     ["-4", "-C"]])
def test_ssh_options_with_their_values_pass(options):
    parse_cluster(_ssh_node(options))


def _ssh_node(options: list[str]) -> str:
    return f"model: {{preset: tiny}}\nnodes:\n  - {{name: a, launch: ssh, host: gpu1, ssh_options: {options}}}\n"
