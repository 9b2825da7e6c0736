"""`hetlaunch certs init DIR [--host H ...]`: a private CA and the certificates a cluster needs
for mutual TLS on the control plane, made with the `cryptography` package (the `[tls]` extra).

DIR gets ca.pem + ca.key (keep the key offline: it signs new agents), coordinator.pem + .key
(valid for localhost, 127.0.0.1, ::1 and every --host, which must include the address agents
dial), agent.pem + .key (one client certificate the agents may share; `certs agent` can make
more later). Keys are P-256, written 0600; every file is written whole or not at all.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from hetlaunch.runtime.files import write_whole

VALID_DAYS = 825  # the longest validity TLS clients accept for a leaf
FILES = ("ca.pem", "ca.key", "coordinator.pem", "coordinator.key", "agent.pem", "agent.key")


class CertError(Exception):
    """Bad input for certs, said in one line."""


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise CertError("certs needs the cryptography package: pip install 'hetlaunch[tls]'") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    directory: Path
    files: list[str]
    hosts: list[str]


def _san(x509, host: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


# A DNS label (RFC 1123): letters, digits and inner hyphens, 63 at most; a leading "*." is a wildcard.
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_host(host: str) -> str:
    """The host as the certificate names it: an IP address, or a DNS name a client could dial
    (a trailing dot dropped: OpenSSL matches `coordinator.` to no client's `coordinator`); else
    one line. `a..b`, `1.2.3.4/24`, `[::1]`, `10.0.0.256` or a name with an escape sequence went
    into the certificate as DNS names (hostile reviews)."""
    if not host.isascii():  # a certificate names hosts in ASCII (IDNA); cryptography raised a traceback
        try:
            ascii_form = f": give its ASCII form, {host.encode('idna').decode('ascii')}"
        except UnicodeError:
            ascii_form = ""
        raise CertError(f"--host {host!r} is not ASCII{ascii_form}")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    name = host.removesuffix(".")
    labels = name.removeprefix("*.").split(".")
    # A top-level label is never all digits: 10.0.0.256 or 1.2.3.4. is a mistyped address, not a name.
    if (not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels)
            or (len(labels) > 1 and labels[-1].isdigit())):
        raise CertError(f"--host {host!r} is not a host name or an IP address")
    return name


def init_certs(directory: Path, hosts: list[str]) -> Issued:
    x509, hashes, serialization, ec, eku, oid = _crypto()
    hosts = [check_host(host) for host in hosts]
    # Any of the files it writes: a second CA would not sign what the first trusts, and a key
    # replaced under a running coordinator or agent (coordinator.key alone went silently) breaks it.
    there = sorted((name for name in FILES if (directory / name).exists()), key=lambda name: not name.endswith(".key"))
    if there:
        raise CertError(f"{directory / there[0]} exists: certs init makes a new CA and every pair it signs "
                        "(remove the directory to start over)")
    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def cert(subject: str, public_key, issuer_name, issuer_key, *, ca: bool, usage=None, sans=()):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(oid.COMMON_NAME, subject)]))
                   .issuer_name(issuer_name).public_key(public_key).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=VALID_DAYS if not ca else 3650))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
        if usage is not None:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(oid.COMMON_NAME, "hetlaunch cluster CA")])
    ca_cert = cert("hetlaunch cluster CA", ca_key.public_key(), ca_name, ca_key, ca=True)
    all_hosts = list(dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]))
    coord_key, agent_key = key(), key()
    coord_cert = cert("hetlaunch coordinator", coord_key.public_key(), ca_name, ca_key, ca=False,
                      usage=eku.SERVER_AUTH, sans=[_san(x509, h) for h in all_hosts])
    agent_cert = cert("hetlaunch agent", agent_key.public_key(), ca_name, ca_key, ca=False, usage=eku.CLIENT_AUTH)

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    def pem_cert(c) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    directory.mkdir(parents=True, exist_ok=True)
    files = {"ca.pem": (pem_cert(ca_cert), 0o644), "ca.key": (pem_key(ca_key), 0o600),
             "coordinator.pem": (pem_cert(coord_cert), 0o644), "coordinator.key": (pem_key(coord_key), 0o600),
             "agent.pem": (pem_cert(agent_cert), 0o644), "agent.key": (pem_key(agent_key), 0o600)}
    for name, (data, mode) in files.items():
        write_whole(directory / name, data, mode)
    return Issued(directory, list(files), all_hosts)
