"""Certificates for mutual TLS between Envoy and the services: one CA, a server certificate per
service, a client certificate for Envoy (`llmgw certs --out DIR`, the local stack's run dir).

Only Envoy reports outcomes: the services accept a connection only with a certificate of this
CA, and their access-log servicers only Envoy's (llmgw/tls.py). The CA's key is not written:
to add a service or rotate, generate a new directory and roll it out whole.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.tls import ENVOY_IDENTITY

SERVICES = ("extauthz", "ratelimit", "router", "ledger")
NAMESPACE = "llmgw"  # deploy/k8s
CA_FILE = "ca.crt"
VALID = datetime.timedelta(days=365)

Key = ec.EllipticCurvePrivateKey


def service_names(service: str) -> list[str]:
    """What Envoy may call a service: its bare name (compose; what Envoy's SAN match names),
    its Kubernetes Service names, and this machine (the local stack)."""
    k8s = f"{service}.{NAMESPACE}"
    return [service, k8s, f"{k8s}.svc", f"{k8s}.svc.cluster.local", "localhost", "127.0.0.1"]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _builder(subject: str, issuer: x509.Name, key: Key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
        .not_valid_after(now + VALID)
    )


class Authority:
    """A CA that lives as long as this object: it signs, and only its certificate is kept."""

    def __init__(self, name: str = "llmgw-ca") -> None:
        self.key: Key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            _builder(name, _name(name), self.key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, common_name: str, names: Sequence[str], *, client: bool
    ) -> tuple[x509.Certificate, Key]:
        """A leaf for `common_name` with `names` as SANs: a client's (EKU clientAuth) or a
        server's (serverAuth), each usable for that role only."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        cert = (
            _builder(common_name, self.cert.subject, key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert, key

    def write(self, out: Path, name: str, names: Sequence[str], *, client: bool) -> None:
        """`out/NAME.crt` and `out/NAME.key` (0600)."""
        cert, key = self.issue(name, names, client=client)
        _write(out / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _write(out / f"{name}.key", pem, secret=True)


def _write(path: Path, data: bytes, secret: bool = False) -> None:
    # Created with its mode: a key is never readable by others, not even for an instant.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate(out: Path, ca: Authority | None = None, services: Sequence[str] = SERVICES) -> Path:
    """The CA's certificate (a fresh CA unless given), Envoy's client pair and each service's
    server pair in `out` (made 0700); `out`."""
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o700)
    ca = ca or Authority()
    _write(out / CA_FILE, ca.cert.public_bytes(serialization.Encoding.PEM))
    ca.write(out, ENVOY_IDENTITY, [ENVOY_IDENTITY], client=True)
    for service in services:
        ca.write(out, service, service_names(service), client=False)
    return out
