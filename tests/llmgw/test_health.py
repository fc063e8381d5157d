"""The image's health check for the admin API: HTTP `GET /health`, its port from the
environment (the other services answer gRPC health: tests/tools/test_certs.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw import health


class Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_admin_apis_health_is_its_http_health_on_its_port(
    server: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = server.server_address[1]
    for key in [k for k in os.environ if k.startswith("LLMGW_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("LLMGW_ADMIN__PORT", str(port))
    monkeypatch.setenv("LLMGW_ADMIN__DATABASE_URL", "postgresql://x")  # not a port
    assert health.default_probe({"LLMGW_ADMIN__PORT": str(port)})[0] == f"127.0.0.1:{port}"
    assert health.main([]) == 0
    assert health.main(["--http", f"127.0.0.1:{port}"]) == 0
    Health.status = 503  # the database does not answer
    try:
        assert health.main([]) == 1
    finally:
        Health.status = 200
    # A nested port (a client's Redis) names no service.
    assert health.main([]) == 0
    monkeypatch.delenv("LLMGW_ADMIN__PORT")
    monkeypatch.setenv("LLMGW_RATELIMIT__REDIS__PORT", str(port))
    assert health.main([]) == 2


def test_a_grpc_service_is_asked_over_grpc_whatever_else_is_set() -> None:
    env = {"LLMGW_LEDGER__SERVE__HEALTH_PORT": "9204", "LLMGW_ADMIN__PORT": "8086"}
    assert health.default_probe(env)[0] == "127.0.0.1:9204"
