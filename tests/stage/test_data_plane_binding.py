"""data_plane: the interface gloo/NCCL bind is set before the group is made, and the port range is
checked against the host's ephemeral ports (gloo and NCCL cannot be told which ports to bind)."""

from __future__ import annotations

import os
import socket

import pytest

from hetlaunch.protos import control_pb2 as pb
from hetlaunch.runtime.data_plane import DataPlaneRefusal, bind_to_network, ephemeral_ports


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # restored after the test, whatever it sets
        monkeypatch.setenv(name, "unset-by-test")
        monkeypatch.delenv(name)


def test_the_interface_is_set_for_gloo_and_nccl_or_refused_naming_what_the_host_has(clean_env):
    loopback = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    bind_to_network(pb.Rendezvous(interface=loopback))
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == loopback
    with pytest.raises(DataPlaneRefusal, match=rf"data_plane.interface: 'eth9x' is not a network interface of .* \(it has: .*{loopback}"):
        bind_to_network(pb.Rendezvous(interface="eth9x"))


def test_the_port_range_must_hold_the_hosts_ephemeral_ports(clean_env, tmp_path):
    low, high = ephemeral_ports()
    bind_to_network(pb.Rendezvous(port_low=min(low, 1024), port_high=65535))  # holds it: fine
    with pytest.raises(DataPlaneRefusal, match=rf"hands out ports {low}-{high} .*net.ipv4.ip_local_port_range"):
        bind_to_network(pb.Rendezvous(port_low=low + 1, port_high=high))
    fake = tmp_path / "range"
    fake.write_text("40000\t40999\n")
    assert ephemeral_ports(str(fake)) == (40000, 40999)


def test_yaml_checks_the_range_and_the_interface_name():
    from conftest import error_of

    assert "data_plane.port_range: must be [low, high] with 1024 <= low <= high <= 65535 (got [5000, 4000])" in \
        error_of("data_plane: {port_range: [5000, 4000]}\nnodes: [{name: a}]")
    assert "nodes[0].data_plane.interface: must match" in error_of("nodes: [{name: a, data_plane: {interface: 'e th0'}}]")
