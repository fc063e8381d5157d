"""Only Envoy reports outcomes: mutual TLS between Envoy and the services' ports (llmgw/tls.py).

A forged access-log batch (5M tokens charged to a real tenant) changes nothing when it comes
over plaintext or with a certificate of the run's CA that is not Envoy's; the same batch with
Envoy's certificate is recorded and charged, so each refusal is the port's doing, not the
batch's. Envoy's own traffic through the same ports: tests/e2e/test_ledger_e2e.py and the others.
"""

from __future__ import annotations

import socket
import ssl
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmgw import wire
from llmgw.health import default_target
from llmgw.tls import ENVOY_IDENTITY
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ledger_e2e import recorded, records
from tests.eventually import eventually
from tests.ledger.test_entry import entry
from tools import certs
from tools.stack import Stack

ACCESS_LOG = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
FORGED = {wire.META_PROMPT_TOKENS: 5_000_000, wire.META_COMPLETION_TOKENS: 1}


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(stack_settings(), tmp_path_factory.mktemp("mtls") / "stack") as running:
        yield running


def forged_batch(stack: Stack) -> tuple[str, str, als_pb2.StreamAccessLogsMessage]:
    """A batch that charges the free tenant 5M tokens: (tenant, request ID, batch)."""
    tenant = next(t for t in stack.tenants if t["tier"] == "free")
    request_id = f"forged-{uuid.uuid4().hex[:8]}"
    e = entry(200, usage=FORGED, request_id=request_id)
    authz = e.common_properties.metadata.filter_metadata[wire.EXTAUTHZ_NAMESPACE]
    authz.update({wire.META_TENANT: tenant["id"], wire.META_TIER: tenant["tier"]})
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.append(e)
    return tenant["id"], request_id, message


def send(channel: grpc.Channel, message: als_pb2.StreamAccessLogsMessage) -> None:
    als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([message]), timeout=5)


def client_credentials(stack: Stack, cert: Path, key: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=(stack.certs / certs.CA_FILE).read_bytes(),
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )


def envoys(stack: Stack) -> grpc.ChannelCredentials:
    name = stack.certs / ENVOY_IDENTITY
    return client_credentials(stack, name.with_suffix(".crt"), name.with_suffix(".key"))


def mallorys(stack: Stack, tmp_path: Path) -> grpc.ChannelCredentials:
    """A client certificate of the run's own CA, not Envoy's."""
    stack.ca.write(tmp_path, "mallory", ["mallory"], client=True)
    return client_credentials(stack, tmp_path / "mallory.crt", tmp_path / "mallory.key")


def tenant_state(stack: Stack, tenant: str) -> dict[bytes, bytes | None]:
    """Every Redis key of the tenant (windows, reservations, breaker) and its value."""
    with stack.redis_client() as r:
        return {k: r.dump(k) for k in r.scan_iter(f"*{{{tenant}}}*")}  # type: ignore[misc]


def metric(url: str, line: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    values = [float(s.rsplit(" ", 1)[1]) for s in text.splitlines() if s.startswith(line + " ")]
    return values[0] if values else 0.0


def refused(stack: Stack, service: str) -> float:
    return metric(stack.metrics[service], f'llmgw_refused_peers_total{{method="{ACCESS_LOG}"}}')


def entries(stack: Stack) -> float:
    return metric(stack.metrics["ledger"], "llmgw_ledger_log_entries_total")


def port(stack: Stack, service: str) -> int:
    address = getattr(stack.services, service)
    assert address is not None
    return int(address.port)


def test_a_forged_batch_changes_nothing_unless_it_comes_with_envoys_certificate(
    tls_stack: Stack, tmp_path: Path
) -> None:
    tenant, request_id, batch = forged_batch(tls_stack)
    target = f"127.0.0.1:{port(tls_stack, 'ledger')}"
    before, received = tenant_state(tls_stack, tenant), entries(tls_stack)
    refusals = refused(tls_stack, "ledger")

    with grpc.insecure_channel(target) as plain, pytest.raises(grpc.RpcError) as no_tls:
        send(plain, batch)
    assert no_tls.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake failed
    with (
        grpc.secure_channel(target, mallorys(tls_stack, tmp_path)) as other,
        pytest.raises(grpc.RpcError) as not_envoy,
    ):
        send(other, batch)
    assert not_envoy.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused(tls_stack, "ledger") == refusals + 1

    with grpc.secure_channel(target, envoys(tls_stack)) as envoy:  # the control
        send(envoy, batch)
    record = recorded(tls_stack, {request_id})[request_id]
    # Nothing of the refused sends reached the ledger: only the control's entry was received,
    # recorded and charged (Envoy's flushes of other traffic: none, the stack is idle).
    assert entries(tls_stack) == received + 1
    assert record["tenant"] == tenant
    eventually(lambda: tenant_state(tls_stack, tenant) != before, 10.0, "the control is charged")
    assert [r["request_id"] for r in records(tls_stack)].count(request_id) == 1


def test_the_routers_access_log_on_extauthz_takes_only_envoy(
    tls_stack: Stack, tmp_path: Path
) -> None:
    _, _, batch = forged_batch(tls_stack)
    target = f"127.0.0.1:{port(tls_stack, 'extauthz')}"
    before = refused(tls_stack, "extauthz")
    with grpc.insecure_channel(target) as plain, pytest.raises(grpc.RpcError) as no_tls:
        send(plain, batch)
    assert no_tls.value.code() == grpc.StatusCode.UNAVAILABLE
    with (
        grpc.secure_channel(target, mallorys(tls_stack, tmp_path)) as other,
        pytest.raises(grpc.RpcError) as not_envoy,
    ):
        send(other, batch)
    assert not_envoy.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused(tls_stack, "extauthz") == before + 1
    with grpc.secure_channel(target, envoys(tls_stack)) as envoy:
        send(envoy, batch)  # the control: served


def over_tls(context: ssl.SSLContext, host: str, port: int, request: bytes) -> bytes:
    """What the server answers `request` over TLS; b"" when it refused the handshake (with TLS
    1.3 the client learns it on its first read)."""
    try:
        with (
            socket.create_connection((host, port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="extauthz") as tls,
        ):
            tls.sendall(request)
            return tls.recv(1024)
    except (ssl.SSLError, ConnectionResetError):
        return b""


def test_the_http_check_port_needs_a_client_certificate_of_the_ca(tls_stack: Stack) -> None:
    address = tls_stack.services.extauthz_http
    assert address is not None
    check = b"GET /.llmgw/extauthz/health HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    with socket.create_connection((address.host, address.port), timeout=5) as raw:
        raw.sendall(check)  # plaintext: never answered as HTTP
        assert not raw.recv(1024).startswith(b"HTTP/1.1")

    context = ssl.create_default_context(cafile=tls_stack.certs / certs.CA_FILE)
    assert not over_tls(context, address.host, address.port, check).startswith(b"HTTP/1.1")

    pair = tls_stack.certs / ENVOY_IDENTITY
    context.load_cert_chain(pair.with_suffix(".crt"), pair.with_suffix(".key"))
    answer = over_tls(context, address.host, address.port, check)
    assert answer.startswith(b"HTTP/1.1 204")  # the control: answered


def test_health_is_plaintext_on_its_own_port_and_nothing_else_is(tls_stack: Stack) -> None:
    ledger = next(p for p in tls_stack.processes if p.name == "ledger")
    target = default_target(ledger.env)  # the image's HEALTHCHECK, from the ledger's environment
    assert target != f"127.0.0.1:{port(tls_stack, 'ledger')}"
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as other:
            send(channel, forged_batch(tls_stack)[2])
        assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
