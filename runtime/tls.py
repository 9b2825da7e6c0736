"""TLS for the control plane: the coordinator's server credentials and an agent's channel.

`coordinator.tls: {cert, key, ca}` in the YAML: the coordinator presents `cert`; with `ca` it
also requires every agent to present a certificate signed by that CA (mutual TLS). An agent
always verifies the coordinator against its `--ca` and, for mutual TLS, presents `--cert` and
`--key`. The join token is still required on every RPC; TLS keeps it (and everything else on the
control plane) from being read or changed on the way. Files are PEM, read once, each failure
a one-line error naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hetlaunch.runtime.files import UnreadableFile, read_regular_file

if TYPE_CHECKING:
    import grpc

MAX_PEM_BYTES = 1 << 20


class TlsError(ValueError):
    """A certificate or key that cannot be used, said in one line."""


def read_pem(path: str | Path, what: str) -> bytes:
    p = Path(path)
    try:
        data = read_regular_file(p, MAX_PEM_BYTES)  # a FIFO in its place once held `up` forever
    except FileNotFoundError:
        raise TlsError(f"{what} {p}: no such file") from None
    except UnreadableFile as err:
        raise TlsError(f"{what} {p}: {err}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{what} {p}: not a PEM file")
    return data


def server_credentials(cert: str, key: str, ca: str | None) -> grpc.ServerCredentials:
    """The coordinator's side; with `ca`, clients without a certificate it signed are refused."""
    import grpc  # here: `validate` reads the PEM files (read_pem) without loading grpc

    pair = (read_pem(key, "coordinator.tls.key"), read_pem(cert, "coordinator.tls.cert"))
    if ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=read_pem(ca, "coordinator.tls.ca"),
                                       require_client_auth=True)


@dataclass(frozen=True)
class ClientTls:
    """An agent's TLS material, read once: for its own channel and for its workers' (the store)."""

    ca_pem: bytes
    cert_pem: bytes = b""
    key_pem: bytes = b""

    @classmethod
    def read(cls, ca: str, cert: str | None = None, key: str | None = None) -> ClientTls:
        if (cert is None) != (key is None):
            raise TlsError("--cert and --key go together (the agent's certificate and its private key)")
        return cls(read_pem(ca, "--ca"), read_pem(cert, "--cert") if cert else b"", read_pem(key, "--key") if key else b"")

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem or None,
                                            certificate_chain=self.cert_pem or None)
