"""tools/certs.py: what `llmgw certs --out DIR` writes, and who may use which certificate."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.health import default_target
from llmgw.tls import ENVOY_IDENTITY
from tools import certs, cli


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_llmgw_certs_writes_keys_for_their_owner_only(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    assert cli.main(["certs", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    names = [ENVOY_IDENTITY, *certs.SERVICES]
    assert {p.name for p in out.iterdir()} == {certs.CA_FILE} | {
        f"{n}.{ext}" for n in names for ext in ("crt", "key")
    }
    for name in names:
        assert stat.S_IMODE((out / f"{name}.key").stat().st_mode) == 0o600


def test_envoy_is_a_client_only_and_each_service_a_server_of_its_names(tmp_path: Path) -> None:
    out = certs.generate(tmp_path / "tls")
    ca = load(out / certs.CA_FILE)
    for name, usage in [(ENVOY_IDENTITY, ExtendedKeyUsageOID.CLIENT_AUTH)] + [
        (s, ExtendedKeyUsageOID.SERVER_AUTH) for s in certs.SERVICES
    ]:
        cert = load(out / f"{name}.crt")
        cert.verify_directly_issued_by(ca)
        assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [usage]
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = set(sans.get_values_for_type(x509.DNSName))
        if name == ENVOY_IDENTITY:
            assert dns == {ENVOY_IDENTITY}
        else:  # compose, Kubernetes, this machine
            assert {name, f"{name}.llmgw.svc.cluster.local", "localhost"} <= dns
            assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def test_the_image_health_check_prefers_the_plaintext_health_port() -> None:
    env = {"LLMGW_LEDGER__SERVE__PORT": "9004", "LLMGW_LEDGER__SERVE__HEALTH_PORT": "9204"}
    assert default_target(env) == "127.0.0.1:9204"
    assert default_target({"LLMGW_LEDGER__SERVE__PORT": "9004"}) == "127.0.0.1:9004"
